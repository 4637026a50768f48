"""The gpt-oss family (model.name = "gpt_oss"): transformers' GptOssForCausalLM as a model of
ours (model.py: sinks, alternating sliding-window and full attention, YaRN, biases, the MoE layer
of models/moe/ with a biased router, expert biases and the clamped SwiGLU), its Hugging Face
names (hf.py), and the one `FAMILY` object the framework asks (models.FAMILIES["gpt_oss"]): the
MoE family's, with what differs replaced."""

import dataclasses

from torchtitan_amp.memory import GptOssDims
from torchtitan_amp.models import moe
from torchtitan_amp.models.gpt_oss.hf import ADAPTER
from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS, GptOssModelArgs, GptOssTransformer, flops_per_token
from torchtitan_amp.models.gpt_oss.parallelize import tp_block_plan

FAMILY = dataclasses.replace(
    moe.FAMILY,
    name="gpt_oss",
    model_cls=GptOssTransformer,
    args_cls=GptOssModelArgs,
    flavors=GPT_OSS_FLAVORS,
    flops_per_token=flops_per_token,
    hf=ADAPTER,
    tp_block_plan=tp_block_plan,
    memory_dims=GptOssDims.from_args,
)
