"""Every wait and limit of gpulaunch that is not a user setting, named in one place.

The waits a user may need to change are ``LaunchOptions`` fields (timeout, shutdown_grace,
start_timeout, node_lost_timeout, hang_timeout); their defaults are here too. The rest bound
internal hand-offs that take milliseconds when things work and must not hang when they don't.
docs/reliability.md lists each with what it protects.
"""

# ----------------------------------------------------------------- defaults of user settings
DEFAULT_TIMEOUT_S = 10800.0            # 3 h, as the seed product
DEFAULT_SHUTDOWN_GRACE_S = 5.0         # SIGTERM -> SIGKILL when stopping ranks
DEFAULT_START_TIMEOUT_S = 180.0        # node agents up (they import torch), Ray placement
DEFAULT_NODE_LOST_TIMEOUT_S = 30.0     # a node agent silent this long is lost
DEFAULT_MAX_ARG_BYTES = 1 << 30        # 1 GiB: past this, load the data inside the function
RESULT_WARN_BYTES = 256 << 20          # a rank's result over this: warn (GPULAUNCH_RESULT_WARN_BYTES)
DEFAULT_KEEP_ALIVE_S = 900.0           # keep_alive=True: an idle pool closes after 15 min
POOL_EXIT_WAIT_S = 5.0                 # a pool rank seen dying: wait this long for its exit code
DEFAULT_CPU_WORKERS = 2                # gpus=None on a host without GPUs

# ----------------------------------------------------------------- internal bounds
RENDEZVOUS_TIMEOUT_S = 600.0           # agents' store: every node joins within this
PG_TIMEOUT_S = 1800.0                  # runtime.init()'s default collective timeout
STANDBY_ACK_TIMEOUT_S = 10.0           # a live standby agent acknowledges in milliseconds
MASTER_PORT_WAIT_S = 120.0             # Ray node 0 opens its store (after importing torch)
HANG_TEARDOWN_WAIT_S = 20.0            # multi-node: a node that saw a hang waits for the caller
STACK_DUMP_WAIT_S = 1.0                # faulthandler writes from a signal handler
FORK_QUIET_WAIT_S = 10.0               # the agent's helper threads pause network calls to fork
AGENT_STOP_EXTRA_S = 5.0               # after shutdown_grace, the caller SIGKILLs the agent
RAY_STOP_EXTRA_S = 15.0                # after shutdown_grace, a node actor's stop() is lost
RAY_DRAIN_TIMEOUT_S = 30.0             # last files of a stopped node
RAY_STACKS_TIMEOUT_S = 10.0            # every node dumps its ranks' stacks on a hang
POLL_LOCAL_S = 0.1                     # caller: local run step interval (wakes on agent exit)
POLL_RAY_S = 0.25                      # caller: Ray run step interval
RAY_POLL_WAIT_S = 2.0                  # caller: one round of node polls
TEARDOWN_TIMEOUT_S = 30.0              # rank: teardown after its result is written (env override)
AGENT_MONITOR_S = 0.05                 # agent: how soon a rank's exit is seen

# Variables that only take effect when an interpreter (or a library at load time) starts: a
# process started earlier (a standby agent; the agent forking ranks) would not see a new value.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH_",
                        "PYTORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "LC_")
# Exact names of the same kind (locale and temp folder are read once, at start-up).
STARTUP_ENV_NAMES = ("LANG", "LANGUAGE", "TMPDIR")

# The pipe a forked rank waits on until the agent has forked every rank (elastic_compat).
FORK_GATE_ENV = "GPULAUNCH_FORK_GATE"

# A rank's stdout and stderr share one ordered log file; each line written through the rank's
# sys.stderr starts with this byte (ASCII record separator: invisible), so the caller can print
# it on its own stderr, as torchrun does (rank.torchrun_env writes it, caller.logstream reads it).
STDERR_MARK = b"\x1e"
