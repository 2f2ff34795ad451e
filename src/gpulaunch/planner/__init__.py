"""Memory and step-time planner: which of DDP, FSDP2, ZeRO-1/2/3 (with or without CPU offload) fits
the GPUs, and which is fastest. ``plan()`` for the full picture, ``choose_strategy()`` for
``prepare(strategy="auto")``. Importing this package does not import torch."""
from .catalog import CATALOG
from .memory import STRATEGIES
from .plan import Estimate, NothingFitsError, Plan, choose_strategy, plan
from .shapes import ModelShape
from .training_setup import TrainingSetup

__all__ = ["plan", "choose_strategy", "Plan", "Estimate", "ModelShape", "TrainingSetup", "NothingFitsError",
           "CATALOG", "STRATEGIES"]
