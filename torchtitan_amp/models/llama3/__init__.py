"""The Llama 3 family: its model and flavors (model.py), TP plan (parallelize.py), Hugging Face
adapter (hf.py), memory terms (torchtitan_amp.memory.llama: memory/ stays torch-free, and anything
under models/ imports torch), and the one `FAMILY` object the framework asks for all of them
(models.FAMILIES["llama3"])."""

from torchtitan_amp.memory import ModelDims
from torchtitan_amp.models.llama3.hf import ADAPTER
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, LlamaModelArgs, RMSNorm, Transformer, flops_per_token
from torchtitan_amp.models.llama3.parallelize import AC_REGIONS, BLOCK_NORMS, tp_block_plan
from torchtitan_amp.models.spec import ModelFamily

FAMILY = ModelFamily(
    name="llama3",
    model_cls=Transformer,
    args_cls=LlamaModelArgs,
    flavors=LLAMA3_FLAVORS,
    flops_per_token=flops_per_token,
    tp_block_plan=tp_block_plan,
    block_norms=BLOCK_NORMS,
    ac_regions=AC_REGIONS,
    norm_cls=RMSNorm,
    hf=ADAPTER,
    memory_dims=ModelDims.from_args,
)
