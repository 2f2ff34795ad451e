"""The recipes' tokenizer: a small byte-level BPE trained on the shipped chat data, with a chat
template, shipped in ``assets/tokenizer`` (no hub access needed; a model directory's own
tokenizer wins whenever ``--model`` has one).

The template marks assistant turns with ``{% generation %}`` so TRL's ``assistant_only_loss``
(and Axolotl's ``chat_template`` loss masking) train on answers only.

Regenerate (deterministic; a test checks it matches the shipped files):
    python recipes/llm_common/chat_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

try:
    from . import ASSETS
    from .chat_data import TRAIN_FILE
except ImportError:  # run as a script
    ASSETS = Path(__file__).resolve().parent / "assets"
    TRAIN_FILE = ASSETS / "chat_train.jsonl"

TOKENIZER_DIR = ASSETS / "tokenizer"
VOCAB_SIZE = 1024
PAD, BOS, EOS = "<|pad|>", "<|begin|>", "<|end|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# Each turn: <|role|>\n content <|end|>\n. Only the assistant content and its <|end|> are
# inside {% generation %}, i.e. what the model is trained to produce.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _corpus():
    with open(TRAIN_FILE) as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["content"]


def train_and_save(out_dir: Path = TOKENIZER_DIR) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, additional_special_tokens=ROLE_TOKENS,
                                   model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)


def load_tokenizer(model_path: str | None = None):
    """The model directory's tokenizer when it has one (and a chat template), else ours."""
    from transformers import AutoTokenizer

    if model_path and any((Path(model_path) / f).exists()
                          for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(model_path)
        if tok.chat_template is None:
            tok.chat_template = CHAT_TEMPLATE
            tok.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        return _load_shipped_with_transformers_4()
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _load_shipped_with_transformers_4():
    """The shipped files were written by transformers 5 (``TokenizersBackend``, a class 4.x
    lacks); 4.x (LLM Foundry's environment) builds the same tokenizer from them directly."""
    from transformers import PreTrainedTokenizerFast
    cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"), bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"], pad_token=cfg["pad_token"],
        additional_special_tokens=cfg.get("extra_special_tokens", ROLE_TOKENS),
        model_max_length=cfg.get("model_max_length", 4096),
        model_input_names=["input_ids", "attention_mask"])
    tok.chat_template = (TOKENIZER_DIR / "chat_template.jinja").read_text()
    return tok


if __name__ == "__main__":
    train_and_save()
    print(f"wrote {TOKENIZER_DIR}")
