"""The recipes' chat dataset: generated here, shipped as JSONL, plus loading the user's own.

Every record is ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``, the
conversational format TRL, Unsloth and Axolotl all read.

The generated tasks are chosen so that a model of a few hundred thousand parameters learns them
within a minute of CPU training, which makes "the eval loss fell" a meaningful CI check:
answers follow fixed templates (learnable structure), repeat words from the question (copying,
which attention learns fast) or recall a small closed set of facts (memorisation). Eval examples
use the same templates with values never seen in training (other number pairs, other phrases),
so a falling eval loss means the model learned the templates, not the eval rows.

Regenerate the shipped files (deterministic; a test checks they match):
    python recipes/llm_common/chat_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

try:
    from . import ASSETS
except ImportError:  # run as a script
    ASSETS = Path(__file__).resolve().parent / "assets"

TRAIN_FILE = ASSETS / "chat_train.jsonl"
EVAL_FILE = ASSETS / "chat_eval.jsonl"
GENERATOR_SEED = 1234
N_TRAIN, N_EVAL = 2000, 200

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago", "Cuba": "Havana",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw",
    "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin", "Austria": "Vienna",
    "Hungary": "Budapest", "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia",
    "India": "New Delhi", "China": "Beijing", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Turkey": "Ankara", "Iran": "Tehran", "Ghana": "Accra", "Nigeria": "Abuja",
}
WORDS = ("red blue green small large happy quiet river stone cloud apple tiger window garden "
         "silver paper music winter summer forest ocean candle bridge rocket planet yellow "
         "orange purple little bright dark cold warm fast slow old new tall short round").split()
COLORS = {"the sky": "blue", "grass": "green", "snow": "white", "coal": "black",
          "a banana": "yellow", "a tomato": "red", "an orange": "orange", "a plum": "purple"}


def _numbers(rng, low=1, high=50):
    return rng.randint(low, high), rng.randint(low, high)


def _example(rng: random.Random, held_out: bool) -> tuple[str, str]:
    """One (question, answer). held_out picks values from the eval half of each value space."""
    kind = rng.randrange(6)
    if kind == 0:
        # eval uses odd first operands, train even ones: never the same question
        a, b = _numbers(rng)
        a = a | 1 if held_out else a & ~1 or 2
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        country = rng.choice(sorted(CAPITALS))
        return (f"What is the capital of {country}?",
                f"The capital of {country} is {CAPITALS[country]}.")
    if kind == 2:
        n = rng.randint(2, 4)
        pool = WORDS[len(WORDS) // 2:] if held_out else WORDS[:len(WORDS) // 2]
        phrase = " ".join(rng.choice(pool) for _ in range(n))
        return f"Repeat after me: {phrase}", phrase
    if kind == 3:
        start = rng.randint(1, 20) * 2 + (1 if held_out else 0)
        stop = start + rng.randint(2, 5)
        return (f"Count from {start} to {stop}.",
                ", ".join(str(i) for i in range(start, stop + 1)) + ".")
    if kind == 4:
        thing = rng.choice(sorted(COLORS))
        return f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {COLORS[thing]}."
    pool = WORDS[len(WORDS) // 2:] if held_out else WORDS[:len(WORDS) // 2]
    word = rng.choice(pool)
    return f"Write the word {word} in capital letters.", word.upper()


def generate(n: int, *, held_out: bool, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        q, a = _example(rng, held_out)
        rows.append({"messages": [{"role": "user", "content": q},
                                  {"role": "assistant", "content": a}]})
    return rows


def write_shipped_files() -> None:
    for path, rows in ((TRAIN_FILE, generate(N_TRAIN, held_out=False, seed=GENERATOR_SEED)),
                       (EVAL_FILE, generate(N_EVAL, held_out=True, seed=GENERATOR_SEED + 1))):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------- loading
def _check_chat_rows(ds, source: str) -> None:
    if "messages" not in ds.column_names:
        raise ValueError(
            f"{source} has columns {ds.column_names}, but the recipes need chat format: a "
            "'messages' column whose rows are lists of {'role': ..., 'content': ...} with roles "
            "'system'/'user'/'assistant'. Convert your data (e.g. prompt/response -> "
            "[{'role':'user','content':prompt},{'role':'assistant','content':response}]).")
    first = ds[0]["messages"]
    if not (isinstance(first, list) and first and all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in first)):
        raise ValueError(f"{source}: row 0's 'messages' is {first!r}; expected a list of "
                         "{'role': ..., 'content': ...} dicts.")
    if not any(m["role"] == "assistant" for m in first):
        raise ValueError(f"{source}: row 0 has no 'assistant' message, so there is nothing to "
                         "learn (the loss is computed on assistant turns only).")


def _read(path: str):
    import datasets

    from .table_data import is_table, read_rows
    if is_table(path):               # a Delta table or an object-store URL: gpulaunch.data
        ds = read_rows(path)
        _check_chat_rows(ds, path)
        return ds
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        kind = "json"
    elif lower.endswith(".parquet") or Path(path).is_dir():
        kind = "parquet"
    else:
        raise ValueError(f"--data {path!r}: expected a .jsonl/.json or .parquet file (or a folder "
                         "of parquet files).")
    files = str(Path(path) / "*.parquet") if Path(path).is_dir() else path
    ds = datasets.load_dataset(kind, data_files=files, split="train")
    _check_chat_rows(ds, path)
    return ds


def load_chat_datasets(data: str | None = None, eval_data: str | None = None,
                       eval_fraction: float = 0.05, seed: int = 0, max_eval_rows: int | None = None):
    """(train, eval) datasets. Without ``data`` the shipped files; with ``data`` and no
    ``eval_data`` a held-out ``eval_fraction`` of ``data`` (at least 1 row). ``max_eval_rows``
    keeps the first rows of the eval set only (quick periodic evals on big sets)."""
    train, evaluation = _load_pair(data, eval_data, eval_fraction, seed)
    if max_eval_rows is not None and len(evaluation) > max_eval_rows:
        evaluation = evaluation.select(range(max_eval_rows))
    return train, evaluation


def _load_pair(data, eval_data, eval_fraction, seed):
    if data is None:
        return _read(str(TRAIN_FILE)), _read(str(eval_data or EVAL_FILE))
    train = _read(data)
    if eval_data is not None:
        return train, _read(eval_data)
    if len(train) < 2:
        raise ValueError(f"--data {data!r} has {len(train)} row(s): need at least 2 to hold one "
                         "out for evaluation (or pass --eval-data).")
    n_eval = max(1, int(len(train) * eval_fraction))
    split = train.train_test_split(test_size=n_eval, seed=seed)
    return split["train"], split["test"]


def sample_prompt(eval_ds) -> tuple[str, str]:
    """The first eval conversation's user turn and its reference answer, for the demo generation."""
    messages = eval_ds[0]["messages"]
    user = next(m["content"] for m in messages if m["role"] == "user")
    answer = next(m["content"] for m in messages if m["role"] == "assistant")
    return user, answer


if __name__ == "__main__":
    write_shipped_files()
    print(f"wrote {TRAIN_FILE} and {EVAL_FILE}")
