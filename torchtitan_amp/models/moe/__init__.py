"""The mixture-of-experts family (model.name = "moe"): Llama 3's decoder with MoE layers
(model.py, moe.py), load balancing between steps (balance.py), Llama's TP plan for attention and
dense blocks (parallelize.py), and the one `FAMILY` object the framework asks (models.FAMILIES["moe"]):
Llama's, with what differs replaced (its norms and AC regions are Llama's blocks' own)."""

import dataclasses

from torchtitan_amp.memory import MoEDims
from torchtitan_amp.models import llama3
from torchtitan_amp.models.moe import balance
from torchtitan_amp.models.moe.hf import ADAPTER
from torchtitan_amp.models.moe.model import MOE_FLAVORS, MoEModelArgs, MoETransformer, flops_per_token
from torchtitan_amp.models.moe.parallelize import tp_block_plan

FAMILY = dataclasses.replace(
    llama3.FAMILY,
    name="moe",
    model_cls=MoETransformer,
    args_cls=MoEModelArgs,
    flavors=MOE_FLAVORS,
    flops_per_token=flops_per_token,
    tp_block_plan=tp_block_plan,
    memory_dims=MoEDims.from_args,
    hf=ADAPTER,
    after_backward=balance.after_backward,
    after_step=balance.after_step,
    set_loss_factor=balance.set_aux_grad_scale,
    compile_fullgraph=False,
)
