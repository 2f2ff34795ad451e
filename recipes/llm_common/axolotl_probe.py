"""An Axolotl plugin that puts the recipes' probe (``sft.make_probe``) into the trainer Axolotl
builds, so the Axolotl recipe reports the same step timing, tokens/s, MFU and time split as the
TRL ones. Axolotl loads it from the config (``plugins: [llm_common.axolotl_probe.ProbePlugin]``)
through its documented plugin hooks; ``axolotl.train.train`` then runs the trainer, and the
recipe reads the probe back with ``sft.find_probe(trainer)``.

Imported only inside Axolotl's environment."""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin


class ProbePlugin(BasePlugin):
    def post_trainer_create(self, cfg, trainer):
        import torch

        from . import sft
        # Axolotl's trainer is an HF Trainer without TRL's token counter: let the Trainer count
        # (all ranks, padding excluded) so tokens per step are real tokens.
        trainer.args.include_num_input_tokens_seen = "non_padding"
        device = trainer.args.device
        sft.make_probe(trainer, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
