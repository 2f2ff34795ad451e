"""Hugging Face helpers: a fused LoRA forward for peft models (``fuse_lora``), the decoder
layers compiled one graph for all (``compile_layers``), each decoder layer one ZeRO-3 unit so
that it compiles under DeepSpeed too (``zero3_layer_units``) and the trainer settings that make an
HF/TRL fine-tune fast on the host it runs on (``speed_settings``). Importing this package
imports neither torch nor transformers."""

__all__ = ["fuse_lora", "unfuse_lora", "compile_layers", "uncompile_layers", "speed_settings",
           "zero3_layer_units"]


def __getattr__(name):
    if name in ("fuse_lora", "unfuse_lora"):
        from . import fused_lora
        return getattr(fused_lora, name)
    if name in ("compile_layers", "uncompile_layers"):
        from . import regional_compile
        return getattr(regional_compile, name)
    if name == "zero3_layer_units":
        from .zero3_layers import zero3_layer_units
        return zero3_layer_units
    if name == "speed_settings":
        from .speed import speed_settings
        return speed_settings
    raise AttributeError(name)
