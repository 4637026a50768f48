"""The gpt-oss family against transformers' GptOssForCausalLM (fp32, random weights sharpened so
that routing, the sinks, the clamp and the sliding window all matter), its flavors, its MoE
extensions (router bias, expert biases, clamped SwiGLU), the fp32 rule of its sink attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan_amp.models import get_family
from torchtitan_amp.models.gpt_oss.hf import from_hf_state_dict, to_hf_state_dict
from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS, GptOssModelArgs, GptOssTransformer, SinkAttention
from torchtitan_amp.models.moe.moe import ClampedSwiGLU

SEQ = 40  # > 2 x the debug window (16): sliding and full layers see different keys


def _hf_config(args: GptOssModelArgs):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.moe_inter_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_local_experts=args.n_routed_experts,
        num_experts_per_tok=args.top_k,
        sliding_window=args.sliding_window,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": args.yarn_factor,
            "beta_fast": args.yarn_beta_fast,
            "beta_slow": args.yarn_beta_slow,
            "truncate": args.yarn_truncate,
            "original_max_position_embeddings": args.yarn_original_max_position,
        },
        attn_implementation="eager",
    )


def _sharpened_hf(args: GptOssModelArgs):
    """A random transformers model whose weights are scaled so that routing margins, the sinks, the
    clamp (limit 7) and every bias take part."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(_hf_config(args)).eval()
    std = {"router.weight": 1.0, "sinks": 2.0, "gate_up_proj": 0.6, "down_proj": 0.2, "bias": 0.3}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "embed" not in name and "lm_head" not in name:
                s = next((v for k, v in std.items() if k in name), 0.1)
                p.copy_(s * torch.randn_like(p))
    return model


def _ours(args: GptOssModelArgs, hf_model) -> GptOssTransformer:
    model = GptOssTransformer(args)
    model.init_weights()
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), args))
    return model.eval()


@pytest.fixture(scope="module")
def pair() -> tuple[GptOssModelArgs, object, torch.Tensor]:
    args = dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=64)
    hf = _sharpened_hf(args)
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
    assert set(family.flavors) == {"debugmodel", "20b", "120b"}
    for name, layers, experts, total in (("20b", 24, 32, 20.9e9), ("120b", 36, 128, 116.8e9)):
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
