"""Shared pieces of the LLM fine-tuning recipes (``recipes/trl_*.py``, ``unsloth_*``, ``axolotl_*``,
``llmfoundry_*``). One idea per module:

- ``architectures``: the seed notebooks' model shapes (real and tiny), built randomly or loaded.
- ``chat_data``: the shipped instruction/chat dataset (generated here) and ``--data`` loading.
- ``chat_tokenizer``: the shipped byte-level BPE tokenizer with its chat template.
- ``options``: the command line / notebook options every recipe shares.
- ``sft``: SFTConfig per technique (DDP, FSDP2, ZeRO-3), and the honest "what actually ran" check.
- ``outputs``: save by rank 0 to a local path or fsspec URL, reload, verify, generate.

Recipes import it as ``llm_common`` (the recipes folder is on ``sys.path`` of a script, of a
notebook opened there, and of every rank, since gpulaunch ships the caller's ``sys.path``).
"""

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
