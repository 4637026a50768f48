import math

import pytest
import torch

from torchtitan_amp.models.llama3.model import (
    LLAMA3_FLAVORS,
    RMSNorm,
    Transformer,
    apply_rotary_emb,
    build_model_args,
    count_params,
    flops_per_token,
    precompute_rope,
)

VOCAB = 128256


def _build_debug(seed: int = 0, flavor: str = "debugmodel", max_seq_len: int = 64) -> Transformer:
    """The production path: meta build, to_empty, init_weights."""
    args = build_model_args(flavor, vocab_size=258, max_seq_len=max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _llama_params(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden: int) -> int:
    """Independent count from the published shapes (hidden = SwiGLU width)."""
    kv_dim = n_kv_heads * (dim // n_heads)
    attention = 2 * dim * dim + 2 * dim * kv_dim
    ffn = 3 * dim * hidden
    norms = 2 * dim
    return n_layers * (attention + ffn + norms) + 2 * VOCAB * dim + dim


@pytest.mark.parametrize(
    ("flavor", "shape", "published"),
    [
        ("llama3_8b", (4096, 32, 32, 8, 14336), 8_030_261_248),
        ("llama3_70b", (8192, 80, 64, 8, 28672), 70_553_706_496),
        ("llama3_405b", (16384, 126, 128, 8, 53248), 405_853_388_800),
    ],
)
def test_param_counts_match_published(flavor: str, shape: tuple[int, ...], published: int) -> None:
    assert _llama_params(*shape) == published
    with torch.device("meta"):
        model = Transformer(build_model_args(flavor, vocab_size=VOCAB, max_seq_len=8192))
    assert count_params(model) == published
    assert count_params(model, exclude_embedding=True) == published - VOCAB * shape[0]


def test_debugmodel_forward_shape_and_finite() -> None:
    model = _build_debug()
    tokens = torch.randint(0, 258, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 258)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_init_is_deterministic_per_seed() -> None:
    a, b, c = _build_debug(seed=1), _build_debug(seed=1), _build_debug(seed=2)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.output.weight, c.output.weight)


def test_init_stds_follow_torchtitan() -> None:
    model = _build_debug()
    dim = model.model_args.dim
    std = dim**-0.5
    assert model.output.weight.abs().max() <= 3 * std
    assert torch.equal(model.norm.weight, torch.ones(dim))
    # depth_init: the residual-stream projection of layer i has std 0.02/sqrt(2(i+1)).
    for i in (0, 5):
        measured = model.layers[str(i)].attention.wo.weight.std().item()
        assert measured == pytest.approx(0.02 / math.sqrt(2 * (i + 1)), rel=0.05)


def test_rope_buffers_fp32_and_equal_direct_computation() -> None:
    model = _build_debug(max_seq_len=128)
    args = model.model_args
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert model.rope_cos.shape == (128, args.head_dim // 2)
    assert "rope_cos" not in model.state_dict()
    # Reference in float64 from the textbook formula theta^(-2i/d).
    pos = torch.arange(128, dtype=torch.float64)[:, None]
    i = torch.arange(args.head_dim // 2, dtype=torch.float64)
    angles = pos * args.rope_theta ** (-2 * i / args.head_dim)
    torch.testing.assert_close(model.rope_cos, angles.cos().float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.rope_sin, angles.sin().float(), atol=1e-5, rtol=0)


def test_rope_buffers_fp32_under_bf16_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, _ = precompute_rope(64, 16, 500000.0, use_scaled_rope=False)
    assert cos.dtype == torch.float32


def test_scaled_rope_frequencies() -> None:
    head_dim, theta = 128, 500000.0
    cos, sin = precompute_rope(head_dim, 2, theta, use_scaled_rope=True)
    freqs = torch.atan2(sin[1], cos[1]).double()  # angle at position 1 == frequency
    for k, got in enumerate(freqs.tolist()):
        freq = theta ** (-2 * k / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:  # high frequency: untouched
            expected = freq
        elif wavelen > 8192 / 1:  # low frequency: slowed by the scale factor
            expected = freq / 8
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            expected = (1 - smooth) * freq / 8 + smooth * freq
        assert got == pytest.approx(expected, rel=1e-5), k
    assert LLAMA3_FLAVORS["llama3_8b"].use_scaled_rope
    assert not LLAMA3_FLAVORS["debugmodel"].use_scaled_rope


def test_rotary_matches_complex_interleaved_form() -> None:
    """Same pair layout as torchtitan / Meta checkpoints (view_as_complex)."""
    q, k = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16)
    cos, sin = precompute_rope(16, 8, 10000.0, use_scaled_rope=False)
    rq, rk = apply_rotary_emb(q, k, cos, sin)
    cis = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None, :]
    for x, rotated in ((q, rq), (k, rk)):
        ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * cis).flatten(3)
        torch.testing.assert_close(rotated, ref)
    rq_bf16, _ = apply_rotary_emb(q.bfloat16(), k.bfloat16(), cos, sin)
    assert rq_bf16.dtype == torch.bfloat16


def test_logits_are_causal() -> None:
    model = _build_debug()
    tokens = torch.randint(0, 258, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 258
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(torch.float32).tiny)))
    return torch.finfo(torch.bfloat16).eps * torch.exp2(exponent)


def test_rmsnorm_fp32_inside_autocast_and_keeps_input_dtype() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(512)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 512).bfloat16()
    x32 = x.float()
    ref = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= _bf16_ulp(ref)).all()
    assert (out.float() == ref.bfloat16().float()).float().mean() > 0.99
    # The bound has teeth: the same chain of ops in bf16 misses it widely.
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.bfloat16()
    assert not ((naive.float() - ref).abs() <= _bf16_ulp(ref)).all()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x32).dtype == torch.float32


def test_bf16_params_keep_bf16_residual_stream() -> None:
    """FSDP mixed precision casts parameters, not buffers: bf16 in, bf16 out,
    rope tables still fp32."""
    model = _build_debug(flavor="debugmodel_h64")
    for p in model.parameters():
        p.data = p.data.bfloat16()
    logits = model(torch.randint(0, 258, (2, 16)))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()
    assert model.rope_cos.dtype == torch.float32


def test_autocast_forward_backward() -> None:
    model = _build_debug(flavor="debugmodel_h64")
    tokens = torch.randint(0, 258, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    assert logits.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_pipeline_stage_passes_hidden_states() -> None:
    model = _build_debug()
    full = model.layers
    model.tok_embeddings = None
    model.norm = None
    model.output = None
    del full["5"]
    model.init_weights()  # must skip the removed ends
    hidden = torch.randn(2, 8, model.model_args.dim)
    with torch.no_grad():
        out = model(hidden)
        # Exactly blocks 0-4 in order, no final norm, no output projection.
        expected = hidden
        for i in range(5):
            expected = full[str(i)](expected, model.rope_cos, model.rope_sin)
    assert out.shape == hidden.shape
    assert torch.equal(out, expected) and not torch.equal(out, hidden)
    assert list(model.state_dict())[0].startswith("layers.0.")
    assert not any(k.startswith("layers.5.") for k in model.state_dict())


def test_flops_per_token_8b() -> None:
    args = build_model_args("llama3_8b", vocab_size=VOCAB, max_seq_len=8192)
    n = 8_030_261_248 - VOCAB * 4096
    assert flops_per_token(args, n, 8192) == 6 * n + 12 * 32 * 32 * 128 * 8192


def test_unknown_flavor_lists_allowed() -> None:
    with pytest.raises(ValueError) as err:
        build_model_args("llama3_1b", vocab_size=258, max_seq_len=64)
    for name in ("debugmodel", "debugmodel_h64", "debugmodel_tiny", "llama3_8b", "llama3_70b", "llama3_405b"):
        assert name in str(err.value)


def test_build_model_args_copies() -> None:
    args = build_model_args("debugmodel", vocab_size=300, max_seq_len=128)
    assert (args.vocab_size, args.max_seq_len) == (300, 128)
    assert LLAMA3_FLAVORS["debugmodel"].vocab_size == 258
    assert LLAMA3_FLAVORS["debugmodel_h64"].head_dim == 64
