"""Real-length training data: ``--data long`` (generated multi-turn chats that fill a sequence)
and the dataset choice every recipe makes (``datasets_for``).

The shipped chat rows are ~21 tokens long, so a step over them carries a few hundred real tokens
and "tokens/s" measures Python overhead. The seed notebooks train at 2048-4096 tokens. Two ways
to get there, both without any download:

- ``--packed``: TRL packs the short rows into ``seq_len`` sequences itself (``sft.sft_config``).
  TRL's ``bfd`` packing is padding-free: one flattened row per batch, and attention kept within
  each original row (transformers derives a block-diagonal mask from ``position_ids``).
- ``--data long``: conversations of many turns, generated here from the same tasks as the
  shipped rows (``chat_data``), each grown turn by turn until the next turn would not fit in
  ``seq_len`` tokens of the recipe's own tokenizer, so every row is a nearly full sequence.
  Every framework reads it (Axolotl and LLM Foundry from a JSONL file), none needs packing
  support, and attention stays plain causal (SDPA's fast path on a GPU).

Generation is deterministic (seed, train/eval value split as in ``chat_data``), so every rank
builds the same rows and no rank has to wait for another to write them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .chat_data import _example, load_chat_datasets

PRESETS = ("long",)


def is_preset(data: str | None) -> bool:
    return data in PRESETS


def _conversation_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def long_conversations(tokenizer, *, seq_len: int, n_rows: int, held_out: bool,
                       seed: int) -> list[dict]:
    """``n_rows`` multi-turn chats, each as close to ``seq_len`` tokens as whole turns allow.

    Turns are sized from one batch encoding of their texts plus what the chat template adds
    around a turn (measured once), then every conversation is measured once through the
    template and trimmed if the estimate fell short (BPE merges at turn boundaries)."""
    if seq_len < 64:
        raise ValueError(f"--data long needs --seq-len of at least 64 (got {seq_len})")
    rng = random.Random(seed)
    one = [{"role": "user", "content": "What is 1 plus 1?"},
           {"role": "assistant", "content": "1 plus 1 is 2."}]
    # what a conversation costs once (BOS, a system header) and what the template adds per turn
    header = 2 * _conversation_tokens(tokenizer, one) - _conversation_tokens(tokenizer, one * 2)
    texts = tokenizer([m["content"] for m in one], add_special_tokens=False)["input_ids"]
    per_turn = _conversation_tokens(tokenizer, one) - header - sum(len(t) for t in texts)
    rows = []
    while len(rows) < n_rows:
        pairs = [_example(rng, held_out) for _ in range(max(8, seq_len // 8))]
        ids = tokenizer([x for pair in pairs for x in pair], add_special_tokens=False)["input_ids"]
        messages, used = [], header
        for i, (q, a) in enumerate(pairs):
            cost = per_turn + len(ids[2 * i]) + len(ids[2 * i + 1])
            if used + cost > seq_len:
                break
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            used += cost
        while messages and _conversation_tokens(tokenizer, messages) > seq_len:
            messages = messages[:-2]
        if messages:
            rows.append({"messages": messages})
    return rows


def rows_needed(opts, world_size: int) -> tuple[int, int]:
    """(train rows, eval rows) for ``--data long``: one epoch of the run's optimizer steps, and
    the capped eval set (``--eval-batches``; otherwise two batches per rank)."""
    n_train = max(1, opts.max_steps) * opts.batch_size * opts.grad_accum * world_size
    n_eval = opts.max_eval_rows(world_size) or 2 * opts.batch_size * world_size
    return n_train, n_eval


def datasets_for(opts, tokenizer, world_size: int):
    """(train, eval) datasets of a recipe: the ``long`` preset, or files / the shipped set."""
    if not is_preset(opts.data):
        return load_chat_datasets(opts.data, opts.eval_data, seed=opts.seed,
                                  max_eval_rows=opts.max_eval_rows(world_size))
    n_train, n_eval = rows_needed(opts, world_size)
    train = cached_long_file(tokenizer, seq_len=opts.seq_len, n_rows=n_train, held_out=False,
                             seed=opts.seed)
    evaluation = opts.eval_data or cached_long_file(
        tokenizer, seq_len=opts.seq_len, n_rows=n_eval, held_out=True, seed=opts.seed + 1)
    return load_chat_datasets(train, evaluation, max_eval_rows=opts.max_eval_rows(world_size))


def cached_long_file(tokenizer, *, seq_len: int, n_rows: int, held_out: bool, seed: int) -> str:
    """The generated rows as a JSONL file, made once per (tokenizer, shape, seed) and reused.

    Why a file: generating 2048-token chats costs ~30 ms a row on a CPU, paid by every rank of
    every run otherwise; and a file-backed dataset lets ``datasets`` cache the trainer's
    tokenization between runs too. Written atomically, since all ranks may race to write it."""
    import hashlib
    import os
    import tempfile
    key = hashlib.sha256(json.dumps([tokenizer.name_or_path, len(tokenizer),
                                     tokenizer.chat_template, seq_len, n_rows, held_out, seed,
                                     2]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("GPULAUNCH_LLM_DATA_CACHE")
                or Path(tempfile.gettempdir()) / "gpulaunch-llm-data")
    path = root / f"long-{'eval' if held_out else 'train'}-{seq_len}-{n_rows}-{key}.jsonl"
    if not path.exists():
        rows = long_conversations(tokenizer, seq_len=seq_len, n_rows=n_rows, held_out=held_out,
                                  seed=seed)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        write_jsonl(rows, tmp)
        os.replace(tmp, path)
    return str(path)


def write_jsonl(ds, path: Path) -> str:
    """A dataset's rows as chat JSONL (for frameworks that read files: Axolotl, LLM Foundry)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps({"messages": row["messages"]}, ensure_ascii=False) + "\n"
                     for row in ds)
    return str(path)
