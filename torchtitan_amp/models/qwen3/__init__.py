"""The Qwen3 dense family (model.name = "qwen3"): its model and flavors (model.py), Hugging Face
adapter (hf.py) and the one `FAMILY` object the framework asks (models.FAMILIES["qwen3"]): Llama's,
with what differs replaced. The TP plan is the MoE family's (Llama's plus the per-head q/k norms,
each TP rank normalising its own heads); the memory terms are MoEDims' with every block dense (its
q/k norms and explicit head_dim are Qwen3's)."""

import dataclasses
from typing import Any

from torchtitan_amp.memory import MoEDims
from torchtitan_amp.models import llama3
from torchtitan_amp.models.moe.parallelize import tp_block_plan
from torchtitan_amp.models.qwen3.hf import ADAPTER
from torchtitan_amp.models.qwen3.model import QWEN3_FLAVORS, Qwen3ModelArgs, Qwen3Transformer


def memory_dims(args: Any) -> MoEDims:
    """The memory model's dims of a Qwen3ModelArgs: a decoder of dense blocks only (n_dense_layers =
    n_layers, no routed expert in any block) with the q/k norms and Qwen3's head size."""
    return MoEDims(
        args.dim,
        args.n_layers,
        args.n_heads,
        args.kv_heads,
        args.ffn_hidden,
        args.vocab_size,
        n_dense_layers=args.n_layers,
        qk_norm=True,
        explicit_head_dim=args.head_dim,
        tied=args.enable_weight_tying,
    )


FAMILY = dataclasses.replace(
    llama3.FAMILY,
    name="qwen3",
    model_cls=Qwen3Transformer,
    args_cls=Qwen3ModelArgs,
    flavors=QWEN3_FLAVORS,
    tp_block_plan=tp_block_plan,
    memory_dims=memory_dims,
    hf=ADAPTER,
)
