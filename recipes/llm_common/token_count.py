"""Tokens each optimizer step trained, counted from the batches the Trainer fetches for it.

TRL counts tokens inside ``SFTTrainer.compute_loss`` and the HF Trainer inside its training
step. Unsloth replaces both with its own, so those counters stay at 0 under Unsloth (its H200 row
had no tokens/s). What every one of them keeps is ``Trainer.get_batch_samples``: the training
loop calls it once per optimizer step for exactly that step's micro-batches (the gradient
accumulation fix of transformers 4.46+, which Unsloth relies on too). Wrapping it on the trainer
instance counts the step's real tokens (attention mask, or the flattened length of a
padding-free batch) whatever the training step is. The sums stay on the device until the probe
synchronises at the step's end (no extra host sync), and are summed over ranks at the end.
"""

from __future__ import annotations


def batch_tokens(batch):
    """Real tokens of one collated batch (a tensor, or an int), padding excluded."""
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        return batch["attention_mask"].sum()
    if "position_ids" in batch:         # padding-free: one flattened row
        return batch["position_ids"].shape[-1]
    return batch["input_ids"].numel()


class BatchTokenCounter:
    """Wraps ``trainer.get_batch_samples``; ``take()`` returns the tokens fetched since the last
    call (local to this rank)."""

    def __init__(self, trainer):
        self._pending = []
        self.installed = hasattr(trainer, "get_batch_samples")
        if not self.installed:
            return
        fetch = trainer.get_batch_samples

        def counting(epoch_iterator, num_batches, *args, **kwargs):
            batches, n_items = fetch(epoch_iterator, num_batches, *args, **kwargs)
            self._pending.extend(batch_tokens(b) for b in batches)
            return batches, n_items

        trainer.get_batch_samples = counting

    def take(self) -> int:
        n = sum(int(t) for t in self._pending)
        self._pending.clear()
        return n


def sum_over_ranks(values: list[int], device) -> list[int]:
    """Element-wise sum of every rank's per-step list (all ranks took the same steps)."""
    import torch
    import torch.distributed as dist
    if not values or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]
