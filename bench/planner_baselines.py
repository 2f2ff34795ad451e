"""What the existing estimators say, for the comparison table in docs/planner.md.

Both count model states only (no activations). The functions below restate their published formulas
(accelerate/commands/estimate.py, deepspeed/runtime/zero/stage3.py and stage_1_and_2.py); when the
real packages import, the real functions are called instead and the result says which was used.
"""
from __future__ import annotations


def accelerate_estimate(total_params: int, dtype: str = "bfloat16") -> tuple[int, str]:
    """`accelerate estimate-memory`'s "Training using Adam" column: the largest of its four entries
    for a model whose fp32 size is 4 bytes/parameter."""
    fp32 = 4 * total_params
    try:
        from accelerate.commands.estimate import estimate_training_usage
        return int(max(estimate_training_usage(fp32, dtype).values())), "accelerate (called)"
    except Exception:
        pass
    if dtype == "float32":
        sizes = [fp32, fp32, 2 * fp32, 4 * fp32]
    else:
        sizes = [fp32, fp32 + fp32 // 2, 2 * fp32, 2 * fp32]
    return int(max(sizes)), "accelerate (formula)"


def deepspeed_zero3_gpu(total_params: int, largest_layer_params: int, gpus: int = 1) -> tuple[int, str]:
    """estimate_zero3_model_states_mem_needs, no offload: 4*largest layer + 18*params/gpus."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        _, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=gpus,
                                                          num_nodes=1, cpu_offload=False, cpu_offload_params=False)
        return int(gpu), "deepspeed (called)"
    except Exception:
        return int(4 * largest_layer_params + 18 * total_params // gpus), "deepspeed (formula)"


def deepspeed_zero2_gpu(total_params: int, gpus: int = 1) -> tuple[int, str]:
    """estimate_zero2_model_states_mem_needs, no offload: 4*params + 16*params/gpus."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        _, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=gpus, num_nodes=1,
                                                       cpu_offload=False)
        return int(gpu), "deepspeed (called)"
    except Exception:
        return int(4 * total_params + 16 * total_params // gpus), "deepspeed (formula)"
