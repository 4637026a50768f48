"""The DeepSeek-V3 family (model.name = "deepseek_v3"): multi-head latent attention (mla.py), the
MoE family's layer with DeepSeek-V3's routing (model.py), its Hugging Face adapter (hf.py), its
TP plan (parallelize.py), its memory terms (torchtitan_amp.memory.deepseek_v3: memory/ stays
torch-free), and the one `FAMILY` object the framework asks (models.FAMILIES["deepseek_v3"]): the
MoE family's, with what differs replaced (balancing, loss factor and compile settings are the MoE
family's own)."""

import dataclasses

from torchtitan_amp.memory import MLADims
from torchtitan_amp.models import moe
from torchtitan_amp.models.deepseek_v3.hf import ADAPTER
from torchtitan_amp.models.deepseek_v3.model import (
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3Args,
    DeepSeekV3Transformer,
    flops_per_token,
    takes_labels,
)
from torchtitan_amp.models.deepseek_v3.parallelize import tp_block_plan

FAMILY = dataclasses.replace(
    moe.FAMILY,
    name="deepseek_v3",
    model_cls=DeepSeekV3Transformer,
    args_cls=DeepSeekV3Args,
    flavors=DEEPSEEK_V3_FLAVORS,
    flops_per_token=flops_per_token,
    tp_block_plan=tp_block_plan,
    memory_dims=MLADims.from_args,
    hf=ADAPTER,
    takes_labels=takes_labels,
)
