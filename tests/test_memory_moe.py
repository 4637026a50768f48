"""The memory model of the mixture-of-experts family (torchtitan_amp/memory/moe.py) against the
real model: parameter counts (total and active), the per-layer activation formula against the
tensors autograd saves, the FLOPs the metrics use, and the EP all-to-all's volumes.
(tests/test_dry_run.py checks state and traffic against real FSDP and EP runs.)"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from torchtitan_amp import memory
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models import count_params, get_family
from torchtitan_amp.models.moe.model import active_params
from torchtitan_amp.precision import PrecisionPlan, autocast, memory_spec

FAMILY = get_family("moe")


@pytest.mark.parametrize("flavor", ["debugmodel_moe", "debugmodel_qwen3", "qwen3_30b_a3b", "moe_16b_gqa"])
def test_total_and_active_params_match_the_model(flavor: str) -> None:
    args = FAMILY.flavors[flavor]
    with torch.device("meta"):
        model = FAMILY.build_model(args)
    dims = FAMILY.memory_dims(args)
    assert isinstance(dims, memory.MoEDims)
    specs = dims.param_specs(memory.Stage(0, range(args.n_layers), True, True))
    assert {s.name: s.shape for s in specs} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    total, no_emb = count_params(model), count_params(model, exclude_embedding=True)
    assert dims.total_params() == total
    assert dims.active_params() == active_params(args, no_emb) + (total - no_emb)
    if flavor == "qwen3_30b_a3b":  # the name's 30B total, 3B active
        assert 30.0e9 < dims.total_params() < 31.0e9 and 3.2e9 < dims.active_params() < 3.5e9


def _saved_bytes(model: torch.nn.Module, tokens: torch.Tensor, context) -> int:  # type: ignore[no-untyped-def]
    """Bytes of distinct storages saved for backward, other than parameters and their casts
    (a tensor shaped like a parameter or its transpose); the rotary tables are per stage and cancel in a
    difference of layer counts."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and tuple(t.shape) not in shapes:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context():
        model(tokens)
    return sum(seen.values())


CASES = {
    "debugmodel_moe": {},  # a shared expert, sigmoid-free softmax routing, bias balancing
    "qwen3_like": {
        "n_heads": 4,
        "n_kv_heads": 2,
        "explicit_head_dim": 24,
        "qk_norm": True,
        "n_shared_experts": 0,
        "load_balance": "aux_loss",
    },
}


@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_activation_formula_matches_saved_tensors(case: str, precision: str) -> None:
    """A MoE block's bytes (3 layers minus 1, all MoE) and a dense block's (the first of 3 made
    dense) equal the formula's for this CPU, per token of the microbatch."""
    config = load_config(
        [
            "--model.name",
            "moe",
            "--model.flavor",
            "debugmodel_moe",
            "--mixed_precision.enabled",
            "false" if precision == "fp32" else "true",
        ]
    )
    plan = PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu")
    b, s = 2, 64
    base = dataclasses.replace(FAMILY.flavors["debugmodel_moe"], moe_inter_dim=48, dense_inter_dim=96, **CASES[case])
    measured = {}
    for layers, dense in ((1, 0), (3, 0), (3, 1)):
        args = dataclasses.replace(base, n_layers=layers, n_dense_layers=dense)
        torch.manual_seed(0)
        model = FAMILY.build_model(args)
        model.init_weights()
        plan.apply_router_dtype(model)
        autocast.apply_fp32_islands(plan, model)
        context = functools.partial(autocast.forward_context, plan)
        measured[layers, dense] = _saved_bytes(model, torch.randint(0, 258, (b, s)), context)
    layout = memory.Layout(seq_len=s, local_batch_size=b)
    terms = FAMILY.memory_dims(args).activation_terms(memory_spec.from_plan(plan, FAMILY.norm_cls), layout)
    tokens = layout.microbatch_tokens
    # layer_cpu: what this CPU's attention saves beyond a GPU's (grouped K/V in fp32 here).
    assert (measured[3, 0] - measured[1, 0]) / 2 == (terms.layer + terms.layer_cpu) * tokens
    assert measured[3, 1] - measured[3, 0] == (terms.layer_at(0) - terms.layer) * tokens
    assert terms.layer_at(0) != terms.layer and terms.layer_at(1) == terms.layer


def test_mfu_counts_the_active_experts_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The trainer's MFU numerator (job.build_model_parts -> ModelParts.flops_per_token ->
    metrics) is the family's flops_per_token: 6 x active parameters + attention."""
    from torchtitan_amp.train import dry_run
    from torchtitan_amp.train.job import build_model_parts

    config = load_config(
        [
            "--model.name",
            "moe",
            "--model.flavor",
            "debugmodel_moe",
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "64",
        ]
    )
    job = dry_run.resolve(config, 1)
    built = build_model_parts(job, torch.device("meta"), [0], materialize=False)
    args, dims = job.model_args, job.model_dims
    no_emb = dims.active_params() - args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 64
    assert built.flops_per_token == 6 * no_emb + attention
    dense_equivalent = 6 * (dims.total_params() - args.vocab_size * args.dim) + attention
    assert built.flops_per_token < 0.75 * dense_equivalent


def _alive_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor, context) -> int:  # type: ignore[no-untyped-def]
    """Bytes of distinct storages made by the forward and still alive when it returns, other
    than parameters, their casts and the output: what autograd saved (pack hook) plus what lives
    in Python objects: op-level SAC's cache of saved op outputs and the recompute regions' inputs,
    which no pack hook sees."""
    import gc

    from torch.utils._python_dispatch import TorchDispatchMode

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    made: set[int] = set()
    found: dict[int, tuple[tuple[int, ...], int]] = {}

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            made.update(
                t.untyped_storage().data_ptr()
                for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor)
            )
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        found[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t

    # The objects from before the forward (most of a test session's heap) go to the permanent
    # generation, which neither collect() nor get_objects() walks: the collection and the scan see
    # the objects made since, every tensor object of the forward among them, at a cost that is not
    # the heap's.
    gc.freeze()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context(), Made():
            out = model(tokens)
        gc.collect()
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and _data_ptr(obj) in made:
                found.setdefault(obj.untyped_storage().data_ptr(), (tuple(obj.shape), obj.untyped_storage().nbytes()))
    finally:
        gc.unfreeze()
    skip = params | {out.untyped_storage().data_ptr()}
    return sum(n for ptr, (shape, n) in found.items() if ptr not in skip and shape not in shapes)


def _data_ptr(t: torch.Tensor) -> int | None:
    """A live tensor's storage address; None for the fake and functional tensors an earlier
    torch.compile in this process left alive (they have no data)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


# Bytes per layer of Python-held scalars (see the test below): half the smallest tensor a missed
# activation would be (128 tokens x width >= 1 x 1 byte), so a miss still fails and the scalars'
# count, which depends on what earlier tests in the process created (measured 4-20 bytes), does not.
SCALAR_SLACK = 64
OP_SAC_CASES = {
    "llama": ("llama3", "debugmodel", {}),
    "llama_one_kv_head": ("llama3", "debugmodel", {"n_kv_heads": 1}),
    "moe": ("moe", "debugmodel_moe", {"moe_inter_dim": 48, "dense_inter_dim": 96}),
    "qwen3_like": ("moe", "debugmodel_moe", {"moe_inter_dim": 48, "dense_inter_dim": 96, **CASES["qwen3_like"]}),
}


@pytest.mark.parametrize("save_mm", ["alternate", "all"])
@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16"])
@pytest.mark.parametrize("case", list(OP_SAC_CASES))
def test_op_level_sac_formula_matches_what_stays_alive(case: str, precision: str, save_mm: str) -> None:
    """Under op-level SAC a dense block is one checkpointed region: it keeps (per token) its input
    and the outputs of the saved ops (SDPA; every matmul, or every second one); an MoE block is
    checkpointed by region, its feed-forward recomputed whole (activation_checkpoint.recomputed_whole), so
    it keeps its norms, both regions' inputs and the attention's saved outputs. Measured as a
    difference of layer counts (3 blocks minus 1; with the first of 3 dense for the MoE
    family): equal to ActivationTerms.op_sac_at, but for the MoE layer's [E] int64 token counts,
    held until backward outside autograd's saved tensors (8 E bytes per layer and microbatch), and
    up to SCALAR_SLACK bytes per layer of Python-held scalars (the aux loss kept for the log; some
    appear only after an earlier test's runs: measured 4-20 bytes); a missed tensor of the model
    would be 128 tokens x its width x its dtype's bytes, at least 128."""
    from torchtitan_amp.distributed import activation_checkpoint

    name, flavor, overrides = OP_SAC_CASES[case]
    family = get_family(name)
    config = load_config(
        [
            "--model.name",
            name,
            "--model.flavor",
            flavor,
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--activation_checkpoint.per_op_sac_save_mm",
            save_mm,
            "--mixed_precision.enabled",
            "false" if precision == "fp32" else "true",
        ]
    )
    plan = PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu")
    b, s = 2, 64
    layouts = ((1, 0), (3, 0), (3, 1)) if name == "moe" else ((1, 0), (3, 0))
    measured = {}
    for layers, dense in layouts:
        extra = {"n_dense_layers": dense} if name == "moe" else {}
        args = dataclasses.replace(family.flavors[flavor], n_layers=layers, **overrides, **extra)
        torch.manual_seed(0)
        model = family.build_model(args)
        model.init_weights()
        plan.apply_router_dtype(model)
        autocast.apply_fp32_islands(plan, model)
        activation_checkpoint.apply_ac(model, config.activation_checkpoint, family.ac_regions)
        context = functools.partial(autocast.forward_context, plan)
        measured[layers, dense] = _alive_activation_bytes(model, torch.randint(0, 258, (b, s)), context)
    layout = memory.Layout(seq_len=s, local_batch_size=b, ac_mode="selective", ac_option="op", op_sac_save_mm=save_mm)
    terms = family.memory_dims(args).activation_terms(memory_spec.from_plan(plan, family.norm_cls), layout)
    tokens = layout.microbatch_tokens
    counts = 8 * getattr(args, "n_routed_experts", 0)
    assert abs((measured[3, 0] - measured[1, 0]) / 2 - (terms.layer_op_sac * tokens + counts)) <= SCALAR_SLACK, measured
    if name == "moe":
        dense = measured[3, 1] - measured[3, 0]
        assert abs(dense - ((terms.op_sac_at(0) - terms.layer_op_sac) * tokens - counts)) <= SCALAR_SLACK, measured
        # A dense block is one region (no norms, one input kept): less than an MoE block's regions.
        assert terms.op_sac_at(0) < terms.layer_op_sac
