from torchtitan_amp.models.llama import (
    LLAMA3_FLAVORS,
    LlamaModelArgs,
    Transformer,
    build_model_args,
    count_params,
    flops_per_token,
)

__all__ = [
    "LLAMA3_FLAVORS",
    "LlamaModelArgs",
    "Transformer",
    "build_model_args",
    "count_params",
    "flops_per_token",
]
