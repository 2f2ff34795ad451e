"""The options every LLM recipe takes, from the command line or (in a notebook) as defaults.

Each recipe declares its defaults twice: the seed notebook's settings, used for real models
(``--model PATH`` or ``--full``), and a tiny preset for CI-sized random models, where e.g. a
higher learning rate is what makes a 150k-parameter model learn in 60 steps. A flag the user
passes always wins over both.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field

# Flags only some recipes implement; any other recipe refuses them rather than ignore them.
RECIPE_FLAGS = {
    "load_in_4bit": (("trl_sft_lora_ddp",),
                     "QLoRA's 4-bit base is in trl_sft_lora_ddp (--load-in-4bit); "
                     "axolotl_qlora_ddp loads its base in 4 bits by itself on a GPU"),
}
FLAG_HELP = {"load_in_4bit": "QLoRA: load the base in 4 bits (bitsandbytes nf4, double "
                             "quantization), LoRA on all linear layers"}


@dataclass
class RecipeOptions:
    recipe: str = ""
    arch: str = "llama-3.2-1b"
    model: str | None = None          # local directory with real weights (and maybe a tokenizer)
    full: bool = False                # random init at the real shape (throughput runs)
    data: str | None = None           # JSONL/Parquet chats, "long" or "shipped" (the default)
    eval_data: str | None = None
    output: str | None = None         # local path or fsspec URL; default outputs/<recipe>
    gpus: int | None = None           # ranks; None = every GPU here (2 CPU workers without)
    max_steps: int = 60
    batch_size: int = 2               # per device
    grad_accum: int = 1
    lr: float = 2e-4
    warmup_steps: float = 0         # steps, or a fraction of max_steps when < 1
    scheduler: str = "cosine"
    seq_len: int = 2048
    packed: bool = False              # pack rows into seq_len sequences (TRL packing, bfd)
    layers: int | None = None         # fewer decoder layers than the real shape (same width)
    measure_after: int = 2            # steps left out of steady-state tokens/s (warm-up)
    seed: int = 17
    eval_steps: int = 30
    logging_steps: int = 10
    eval_batches: int | None = None   # cap the eval set (rows = eval_batches * batch_size)
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_train_modules: str | None = None  # comma list trained in full beside LoRA (modules_to_save)
    load_in_4bit: bool = False        # QLoRA: the base in 4 bits (bitsandbytes nf4); RECIPE_FLAGS
    gradient_checkpointing: bool = False
    attn: str | None = None           # attn_implementation ("sdpa", "eager", ...)
    dtype: str = "auto"               # auto: bf16 on GPU, fp32 on CPU
    report_to: str = "auto"           # auto: mlflow when installed and MLFLOW_TRACKING_URI is set
    results: str | None = None        # write the rank-0 result dict as JSON here
    timeout: float = 3 * 3600.0
    speed: str = "auto"               # auto: llm_common.speed's fast settings; off: the seed's plain ones
    extra: dict = field(default_factory=dict)  # recipe-specific settings, -x key=value
    started_at: float = 0.0           # when this process started (set by parse; not a flag)
    given: tuple = ()                 # the flags set on the command line (set by parse; not a flag)

    @property
    def tiny(self) -> bool:
        return not self.full and self.model is None

    def max_eval_rows(self, world_size: int) -> int | None:
        return None if self.eval_batches is None else self.eval_batches * self.batch_size * world_size

    @property
    def save(self) -> bool:
        """False with -x save=false (throughput runs of models too big to write and reload)."""
        return bool(self.extra.get("save", True))

    def output_path(self) -> str:
        return self.output or f"outputs/{self.recipe}"


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules


def _process_start() -> float:
    """This process's start (epoch seconds): interpreter start-up and imports count as start-up
    time in the recipes' time split, not only what follows ``parse``."""
    import time
    try:
        import psutil
        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil missing or /proc unreadable: this moment instead
        return time.time()


def _parse_extra(pairs: list[str]) -> dict:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise SystemExit(f"-x expects key=value, got {p!r}")
        k, v = p.split("=", 1)
        for cast in (int, float):
            try:
                v = cast(v)
                break
            except ValueError:
                pass
        else:
            v = {"true": True, "false": False}.get(v.lower(), v)
        out[k] = v
    return out


def parse(defaults: RecipeOptions, tiny_preset: dict | None = None,
          argv: list[str] | None = None, description: str = "") -> RecipeOptions:
    """Options from ``argv`` (default ``sys.argv[1:]``; none inside a notebook kernel), on top of
    ``defaults``, with ``tiny_preset`` applied to fields the user did not set when the model is
    the tiny random one."""
    if argv is None:
        argv = [] if _in_notebook() else sys.argv[1:]
    parser = argparse.ArgumentParser(description=description or defaults.recipe)
    for f in dataclasses.fields(RecipeOptions):
        if f.name in ("recipe", "extra", "started_at", "given"):
            continue
        flag = "--" + f.name.replace("_", "-")
        current = getattr(defaults, f.name)
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{FLAG_HELP.get(f.name, '')} (default {current})".strip())
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(
                str(f.type), str)
            parser.add_argument(flag, type=kind, default=None, help=f"(default {current})")
    parser.add_argument("-x", "--extra", action="append", metavar="KEY=VALUE",
                        help="recipe-specific setting, repeatable")
    ns = parser.parse_args(argv)
    given = {k: v for k, v in vars(ns).items() if v is not None and k != "extra"}
    for name, (recipes, where) in RECIPE_FLAGS.items():
        if given.get(name) and defaults.recipe not in recipes:
            raise SystemExit(f"--{name.replace('_', '-')} is not an option of "
                             f"{defaults.recipe or 'this recipe'}: {where}")
    opts = dataclasses.replace(defaults, **given)
    opts.started_at = _process_start()
    opts.given = tuple(sorted(given))
    if opts.data == "shipped":      # said explicitly: the shipped rows (what no --data means)
        opts.data = None
    user_extra = _parse_extra(ns.extra)
    opts.extra = {**defaults.extra, **user_extra}
    if opts.tiny and tiny_preset:
        for k, v in tiny_preset.items():
            if k == "extra":     # merged, and -x still wins over the preset
                opts.extra = {**defaults.extra, **v, **user_extra}
            elif k not in given:
                setattr(opts, k, v)
    if "profile" in opts.extra:      # -x profile=START:COUNT: a bad value fails here, not in a rank
        from .step_profile import parse_spec
        parse_spec(opts.extra["profile"])
    return opts
