"""tiny_gelu: a test-only model family (Llama 3 blocks with a GELU MLP) that shows a family is one
folder plus one registration: `register()` is the registry line; it trains, checkpoints, dry-runs
and round-trips Hugging Face folders through the framework's generic code (tests/test_families.py).
"""

from tests.families.tiny_gelu.hf import ADAPTER
from tests.families.tiny_gelu.memory import GeluDims
from tests.families.tiny_gelu.model import FLAVORS, GeluArgs, GeluTransformer, flops_per_token
from tests.families.tiny_gelu.parallel import tp_block_plan
from torchtitan_amp.models import register_family
from torchtitan_amp.models.llama3.model import RMSNorm
from torchtitan_amp.models.spec import ModelFamily

FAMILY = ModelFamily(
    name="tiny_gelu",
    model_cls=GeluTransformer,
    args_cls=GeluArgs,
    flavors=FLAVORS,
    flops_per_token=flops_per_token,
    tp_block_plan=tp_block_plan,
    block_norms=("attention_norm", "ffn_norm"),
    ac_regions=("attention", "feed_forward"),
    norm_cls=RMSNorm,
    hf=ADAPTER,
    memory_dims=GeluDims.from_args,
)


def register() -> None:
    register_family(FAMILY)
