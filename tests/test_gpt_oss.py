"""The gpt-oss family against transformers' GptOssForCausalLM (fp32, random weights sharpened so
that routing, the sinks, the clamp and the sliding window all matter), its flavors, its MoE
extensions (router bias, expert biases, clamped SwiGLU), the fp32 rule of its sink attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.gpt_oss import sharpened_hf
from torchtitan_amp.models import get_family
from torchtitan_amp.models.gpt_oss.hf import from_hf_state_dict, to_hf_state_dict
from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS, GptOssModelArgs, GptOssTransformer, SinkAttention
from torchtitan_amp.models.moe.moe import ClampedSwiGLU

SEQ = 40  # > 2 x the debug window (16): sliding and full layers see different keys


def _ours(args: GptOssModelArgs, hf_model) -> GptOssTransformer:
    model = GptOssTransformer(args)
    model.init_weights()
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), args))
    return model.eval()


@pytest.fixture(scope="module")
def pair() -> tuple[GptOssModelArgs, object, torch.Tensor]:
    args = dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=64)
    hf = sharpened_hf(args)
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    return args, hf, tokens, ref


# fp32 forward: each logit is the end of ~4 blocks x ~10 dependent fp32 roundings of sums over at
# most 64 terms (relative 2^-24 each, summation order differs: GEMM blocking, our split gate/up
# GEMMs, softmax over all experts then renormalised vs softmax of the top k); the bound
# 64 x 40 x 2^-24 ~ 1.5e-4 of the logits' scale covers it; measured 1.7e-5 (1.1e-5 on a scale of 0.67).
TOL = 1.5e-4


def test_forward_matches_transformers(pair) -> None:
    args, hf, tokens, ref = pair
    with torch.no_grad():
        ours = _ours(args, hf)(tokens)
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= TOL * scale


@pytest.mark.parametrize("change", ["no_sinks", "no_window", "no_clamp", "no_router_bias"])
def test_each_feature_matters_beyond_the_tolerance(pair, change: str) -> None:
    """The parity above would fail if a feature were dropped: removing it moves the logits by far
    more than the tolerance (so the random weights exercise it)."""
    args, hf, tokens, ref = pair
    model = _ours(args, hf)
    with torch.no_grad():
        for name, module in model.named_modules():
            if change == "no_sinks" and isinstance(module, SinkAttention):
                module.sinks.fill_(-1e9)
            if change == "no_window" and isinstance(module, SinkAttention):
                module.window = None
            if change == "no_clamp" and hasattr(module, "activation"):
                module.activation = ClampedSwiGLU(limit=1e9)
            if change == "no_router_bias" and name.endswith("router"):
                module.bias.zero_()
        out = model(tokens)
    assert (out - ref).abs().max().item() > 100 * TOL * ref.abs().max().item()


def test_state_dict_round_trip(pair) -> None:
    args, hf, _, _ = pair
    sd = hf.state_dict()
    back = to_hf_state_dict(from_hf_state_dict(sd, args), args)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_flavors_have_the_published_shapes() -> None:
    family = get_family("gpt_oss")
    assert set(family.flavors) == {"debugmodel", "gpt_oss_20b", "gpt_oss_120b"}
    for name, layers, experts, total in (("gpt_oss_20b", 24, 32, 20.9e9), ("gpt_oss_120b", 36, 128, 116.8e9)):
        args = family.flavors[name]
        assert (args.n_layers, args.n_routed_experts, args.top_k, args.dim, args.head_dim) == (
            layers,
            experts,
            4,
            2880,
            64,
        )
        with torch.device("meta"):
            n = sum(p.numel() for p in family.build_model(args).parameters())
        assert abs(n - total) / total < 0.01, (name, n)


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window 0"):
        dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], sliding_window=0)


def test_flavor_of_another_family_is_one_line() -> None:
    from torchtitan_amp.config import load_config
    from torchtitan_amp.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(["--model.name", "gpt_oss", "--model.flavor", "debugmodel_moe"])
    assert str(e.value) == (
        "'model.flavor' = 'debugmodel_moe' is not a flavor of model.name = 'gpt_oss'; "
        "choose one of: 'debugmodel', 'gpt_oss_20b', 'gpt_oss_120b'"
    )


def _recorded_under_bf16_plan() -> dict:
    """The audit's recorder over one forward and backward of the debug model under the bf16
    autocast plan on one process (its forward context and fp32 islands, as the trainer applies
    them): module -> op kind -> dtypes."""
    from tests.test_precision import plan
    from torchtitan_amp.precision import autocast
    from torchtitan_amp.precision.audit import _module_stack, _Recorder

    p = plan("single")
    assert p.autocast_dtype == torch.bfloat16
    args = dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=32)
    torch.manual_seed(0)
    model = GptOssTransformer(args)
    model.init_weights()
    autocast.apply_fp32_islands(p, model)
    # the plan keeps the sinks' and the routers' parameters fp32 (outside the safe list)
    fp32_params = {type(m).__name__ for m in p.fp32_modules(model)}
    assert {"SinkAttention", "Router", "RMSNorm"} <= fp32_params
    fp32 = {n for n, m in model.named_modules() if getattr(m, "computes_in_fp32", False)}
    recorder = _Recorder(fp32)
    with _module_stack([model], recorder), recorder, autocast.forward_context(p):
        model(torch.randint(0, args.vocab_size, (2, 32))).float().sum().backward()
    return recorder.seen


def test_sinks_and_their_softmax_compute_in_fp32_under_the_bf16_plan() -> None:
    """The sink attention computes every op, its two matmuls included, in fp32; the router routes
    in fp32; the q/k/v/o Linears and the experts run in bf16."""
    seen = _recorded_under_bf16_plan()
    for layer in range(GPT_OSS_FLAVORS["debugmodel"].n_layers):
        core = seen[f"layers.{layer}.attention.core"]
        assert core["forward matmul"] == {"float32"} and core["compute"] == {"float32"}, dict(core)
        assert seen[f"layers.{layer}.feed_forward.router"]["forward matmul"] == {"float32"}
        assert seen[f"layers.{layer}.attention.wq"]["forward matmul"] == {"bfloat16"}
        assert seen[f"layers.{layer}.feed_forward.experts"]["forward matmul"] == {"bfloat16"}


def test_sink_attention_in_bf16_would_be_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its autocast guard the sink attention's matmuls run in bf16, and the recorder the
    audit checks (computes_in_fp32 module matmul: promised float32) sees them."""
    import contextlib

    from torchtitan_amp.models.gpt_oss import model as gpt_oss_model

    monkeypatch.setattr(gpt_oss_model, "_no_autocast", lambda device: contextlib.nullcontext())
    assert "bfloat16" in _recorded_under_bf16_plan()["layers.0.attention.core"]["forward matmul"]


@pytest.mark.parametrize("flavor", ["debugmodel", "gpt_oss_20b", "gpt_oss_120b"])
def test_memory_model_names_and_sizes_every_parameter(flavor: str) -> None:
    """The memory model's parameter specs (memory.GptOssDims: the MoE family's plus biases and
    sinks) are exactly the model's parameters, name for name and in total."""
    from torchtitan_amp.memory import Stage
    from torchtitan_amp.models.spec import count_params

    family = get_family("gpt_oss")
    args = family.build_args(flavor, family.flavors[flavor].vocab_size, 128)
    with torch.device("meta"):
        model = family.build_model(args)
    dims = family.memory_dims(args)
    specs = {s.name: s.shape for s in dims.param_specs(Stage(0, range(args.n_layers), True, True))}
    assert specs == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert dims.total_params() == count_params(model)


@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16"])
def test_activation_formula_matches_saved_tensors(precision: str) -> None:
    """A full layer's and a sliding layer's saved-for-backward bytes per token (2 blocks - 1, 3
    - 2) both equal the memory model's terms: the sink attention's fp32 S x S scores (the window
    masks the whole S x S, so a sliding layer saves as much), the clamped SwiGLU, the biases'
    rows. Less the grouped matmul's [E] int32 offsets, which the measure skips: they are shaped
    like the router's bias."""
    from tests.test_deepseek_v3 import saved_bytes_per_block

    args = GPT_OSS_FLAVORS["debugmodel"]
    (full, sliding), terms = saved_bytes_per_block(get_family("gpt_oss"), args, precision, layers=(1, 2, 3))
    expected = terms.layer_at(1) + terms.layer_cpu - 4 * args.n_routed_experts / (3 * 40)
    assert full == sliding == pytest.approx(expected, rel=1e-12)
