"""The mixture-of-experts family (model.name = "moe"): Llama 3's decoder with MoE layers
(model.py, moe.py), load balancing between steps (balance.py), Llama's TP plan for attention and
dense blocks (parallelize.py), and the one `FAMILY` object the framework asks (models.FAMILIES["moe"])."""

from torchtitan_amp.memory import MoEDims
from torchtitan_amp.models.llama3.model import RMSNorm
from torchtitan_amp.models.llama3.parallelize import AC_REGIONS, BLOCK_NORMS
from torchtitan_amp.models.moe import balance
from torchtitan_amp.models.moe.hf import ADAPTER
from torchtitan_amp.models.moe.model import MOE_FLAVORS, MoEModelArgs, MoETransformer, flops_per_token
from torchtitan_amp.models.moe.parallelize import tp_block_plan
from torchtitan_amp.models.spec import ModelFamily

FAMILY = ModelFamily(
    name="moe",
    model_cls=MoETransformer,
    args_cls=MoEModelArgs,
    flavors=MOE_FLAVORS,
    flops_per_token=flops_per_token,
    tp_block_plan=tp_block_plan,
    block_norms=BLOCK_NORMS,
    ac_regions=AC_REGIONS,
    norm_cls=RMSNorm,
    memory_dims=MoEDims.from_args,
    hf=ADAPTER,
    after_backward=balance.after_backward,
    after_step=balance.after_step,
    set_loss_factor=balance.set_aux_grad_scale,
    compile_fullgraph=False,
)
