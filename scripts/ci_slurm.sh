#!/usr/bin/env bash
# Make sure Slurm (slurmctld, slurmd, srun, sbatch) and munge are installed, for
# tests/slurm/test_slurm.py: nothing to do when they are; else apt-get install, non-interactively, as
# root only. Exit 0 when they are installed at the end, 1 (with the reason on stderr) when not;
# the Slurm tests then skip and say why.
set -uo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
have() { for b in munged slurmctld slurmd srun sbatch sinfo scancel squeue; do
  command -v "$b" >/dev/null || return 1; done; }
if [ "$(id -u)" != 0 ]; then
  echo "ci_slurm: not root: slurmd cannot start job steps; the Slurm tests will be skipped" >&2
  exit 1
fi
have && exit 0
if ! command -v apt-get >/dev/null; then
  echo "ci_slurm: slurm-wlm/munge are not installed and there is no apt-get here;" \
       "the Slurm tests will be skipped" >&2
  exit 1
fi
log="${TMPDIR:-/tmp}/gpulaunch-ci-apt-slurm.log"
install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o DPkg::Lock::Timeout=120 slurm-wlm munge
}
echo "ci_slurm: installing slurm-wlm and munge with apt-get (log: $log)" >&2
if ! install >"$log" 2>&1; then
  # a fresh image may have no package lists yet
  DEBIAN_FRONTEND=noninteractive apt-get update -q -o DPkg::Lock::Timeout=120 >>"$log" 2>&1
  install >>"$log" 2>&1
fi
if have; then exit 0; fi
echo "ci_slurm: could not install slurm-wlm/munge; the Slurm tests will be skipped. Last lines" \
     "of $log:" >&2
tail -n 5 "$log" >&2
exit 1
