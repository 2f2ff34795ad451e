"""A Composer callback for the LLM Foundry recipe: the same step timing, tokens per step, eval
loss history and timestamps as ``sft.make_probe`` gives the HF-Trainer recipes. Registered in
llm-foundry's callback registry (``register()``, its documented extension point) and named in
the run config's ``callbacks`` like Foundry's own; the recipe reads it back from
``trainer.state.callbacks``.

Imported only inside LLM Foundry's environment (composer is not installed elsewhere)."""

from __future__ import annotations

import time

from composer.core import Callback

NAME = "llm_common_probe"


class FoundryProbe(Callback):
    llm_common_probe = True

    def __init__(self):
        self.step_times, self.step_tokens, self.eval_losses = [], [], []
        self.eval_seconds, self.fit_begin, self.fit_end_at = 0.0, None, None
        self._t = self._tok = self._e = None

    @staticmethod
    def _now(state):
        import torch
        if state.device.name == "gpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    def fit_start(self, state, logger):
        self.fit_begin = time.time()

    def fit_end(self, state, logger):
        self.fit_end_at = time.time()

    def batch_start(self, state, logger):
        # the whole device batch (all its micro-batches): real tokens, padding excluded
        mask = state.batch.get("attention_mask")
        self._tok = int(mask.sum()) if mask is not None else int(state.batch["input_ids"].numel())
        self._t = self._now(state)

    def batch_end(self, state, logger):
        self.step_times.append(self._now(state) - self._t)
        self.step_tokens.append(self._tok)

    def eval_start(self, state, logger):
        self._e = self._now(state)

    def eval_end(self, state, logger):
        self.eval_seconds += self._now(state) - self._e
        for metrics in state.eval_metrics.values():
            if "LanguageCrossEntropy" in metrics:
                self.eval_losses.append((int(state.timestamp.batch),
                                         float(metrics["LanguageCrossEntropy"].compute())))
                break


def register() -> None:
    from llmfoundry import registry
    if NAME not in registry.callbacks.get_all():
        registry.callbacks.register(NAME, func=FoundryProbe)


def find(trainer) -> FoundryProbe:
    return next(cb for cb in trainer.state.callbacks if getattr(cb, "llm_common_probe", False))
