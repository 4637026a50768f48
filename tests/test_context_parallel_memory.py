"""Context parallel's memory on the attention kernels, in one process: which SDPA kernel a call
runs (rules.attention_kernel), grouped K/V where the kernel takes them (no repeated copy saved),
the start-up refusal where CUDA would build a causal mask, every attention op CP can run in the
selective-AC save list, and no per-forward gather of positions or document ids that are known.
The bytes a CP block saves against the memory model: tests/test_dry_run.py
(test_activation_formula_matches_saved_tensors, with a fake process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan_amp.context_parallel import ContextParallel, gathered_positions, head_tail_positions
from torchtitan_amp.models.llama3 import model as llama
from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer, repeat_kv
from torchtitan_amp.rules import attention_kernel, materialises_causal_mask, takes_grouped_kv


@pytest.mark.parametrize("device, dtype, head_dim, mask, kernel", [
    ("cuda", "bfloat16", 128, "causal", "flash"),
    ("cuda", "float16", 256, "causal", "flash"),
    ("cuda", "bfloat16", 264, "causal", "efficient"),  # past flash's 256, a multiple of 8
    ("cuda", "bfloat16", 260, "causal", "math"),  # neither
    ("cuda", "float32", 128, "causal", "efficient"),
    ("cuda", "float32", 6, "causal", "math"),  # efficient needs a multiple of 4 in fp32
    ("cuda", "bfloat16", 128, "mask", "efficient"),  # flash takes no mask tensor
    ("cuda", "float32", 10, "mask", "math"),
    ("cpu", "bfloat16", 6, "causal", "cpu_flash"),
    ("cpu", "float32", 16, "mask", "cpu_flash"),
    ("xpu", "bfloat16", 128, "causal", "unknown"),
])
def test_attention_kernel_by_device_dtype_head_dim_and_mask(device: str, dtype: str, head_dim: int, mask: str,
                                                            kernel: str) -> None:
    assert attention_kernel(device, dtype, head_dim, mask) == kernel


def test_grouped_kv_only_where_the_kernel_takes_it_exactly() -> None:
    """CUDA: flash takes grouped heads, efficient does not; CPU: fp32 (bitwise as repeated), not
    16 bits (its backward sums a group's dK/dV in 16 bits)."""
    assert takes_grouped_kv("cuda", "bfloat16", 128, "causal")
    assert not takes_grouped_kv("cuda", "float32", 128, "causal")
    assert not takes_grouped_kv("cuda", "bfloat16", 128, "mask")
    assert takes_grouped_kv("cpu", "float32", 16, "causal") and takes_grouped_kv("cpu", "float32", 16, "mask")
    assert not takes_grouped_kv("cpu", "bfloat16", 64, "causal")
    assert materialises_causal_mask("cpu", "bfloat16", 128)  # by design: one [n, end] mask per chunk
    assert not materialises_causal_mask("cuda", "bfloat16", 128) and not materialises_causal_mask("cuda", "float32", 64)
    assert materialises_causal_mask("cuda", "float32", 6)


def _cp_rank(cp: int, rank: int) -> ContextParallel:
    """A cp rank without a process group: the gather is the local keys repeated cp times (the
    other ranks' values do not matter here, only the shapes and the maths after the gather)."""
    methods = {"degree": cp, "rank": rank,
               "gather_kv": lambda self, x: torch.cat([x] * cp, dim=1)}
    return type("Rank", (ContextParallel,), methods)(group=None)  # type: ignore[arg-type]


def _gqa_model(layers: int = 2, seq: int = 32) -> Transformer:
    args = LlamaModelArgs(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                          max_seq_len=seq)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, **extra: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(tokens, **extra).float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
@pytest.mark.parametrize("cp", [1, 2])
def test_grouped_kv_is_bitwise_the_repeated_one_in_fp32(monkeypatch: pytest.MonkeyPatch, cp: int,
                                                        mask_type: str) -> None:
    """GQA in fp32 on CPU, with and without CP (rank 1), causal and block_causal: the loss and every
    gradient are bitwise those of repeating K/V; under causal CP the gradients within fp32
    rounding (each chunk's dK/dV, summed over a group's heads in the kernel, then over the chunks;
    repeat_kv sums the chunks first)."""
    model, seq = _gqa_model(), 32
    if cp > 1:
        for module in model.modules():
            if hasattr(type(module), "context_parallel"):
                module.context_parallel = _cp_rank(cp, 1)
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, seq // cp))
    extra = {} if mask_type == "causal" else {"doc_ids": (torch.arange(seq // cp) // 5).expand(2, -1)}
    if cp > 1:
        extra["positions"] = head_tail_positions(seq, cp, 1).expand(2, -1)
        if mask_type != "causal":
            extra["kv_doc_ids"] = torch.cat([extra["doc_ids"]] * cp, dim=1)
    grouped = _loss_and_grads(model, tokens, **extra)
    monkeypatch.setattr(llama, "grouped_kv", lambda *a: False)
    repeated = _loss_and_grads(model, tokens, **extra)
    assert torch.equal(grouped[0], repeated[0])
    if cp == 1 or mask_type != "causal":
        assert all(torch.equal(grouped[1][n], repeated[1][n]) for n in grouped[1])
    else:  # two chunk calls add into one dK/dV: in another order than repeat_kv's head sum
        worst = max(((grouped[1][n] - repeated[1][n]).norm() / repeated[1][n].norm()).item() for n in grouped[1])
        assert worst < 1e-6, worst


def _saved_shapes(model: Transformer, tokens: torch.Tensor, **extra: torch.Tensor) -> list[tuple[int, ...]]:
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, **extra)
    return shapes


@pytest.mark.parametrize("dtype, kv_saved_heads", [(torch.float32, 2), (torch.bfloat16, 4)])
def test_causal_cp_block_saves_the_window_kv_at_kv_heads(dtype: torch.dtype, kv_saved_heads: int) -> None:
    """Causal CP 2, rank 1: the window's keys and values SDPA saves have the model's 2 kv heads
    in fp32 (this CPU's kernel takes them grouped; so does CUDA's flash kernel in 16 bits), not
    the 4 query heads repeat_kv would copy them to. In bf16 this CPU repeats (exact dK/dV sums)."""
    cp, seq = 2, 32
    model = _gqa_model(layers=1).to(dtype)
    for module in model.modules():
        if hasattr(type(module), "context_parallel"):
            module.context_parallel = _cp_rank(cp, 1)
    shapes = _saved_shapes(model, torch.randint(0, 64, (2, seq // cp)),
                           positions=head_tail_positions(seq, cp, 1).expand(2, -1))
    # SDPA's keys and values: [B, heads, end, head_dim], each chunk's prefix of the window
    kv = {s for s in shapes if len(s) == 4 and s[2] > seq // (2 * cp) and s[3] == 16}
    assert len(kv) == 2 and {s[1] for s in kv} == {kv_saved_heads}, shapes


def test_causal_chunk_attention_takes_grouped_kv_as_repeated() -> None:
    """ContextParallel.causal_attention with enable_gqa equals it on repeat_kv's copy (fp32, CPU):
    output and dQ bitwise, dK and dV within fp32 rounding."""
    cp, seq, n_rep = 2, 32, 2
    torch.manual_seed(0)
    q0 = torch.randn(2, 4, seq // cp, 8)
    kv0 = torch.randn(2, seq, 2, 8), torch.randn(2, seq, 2, 8)
    outs = []
    for grouped in (True, False):
        q = q0.clone().requires_grad_()
        k, v = (t.clone().requires_grad_() for t in kv0)
        kk, vv = (k, v) if grouped else (repeat_kv(k, n_rep), repeat_kv(v, n_rep))
        out = _cp_rank(cp, 1).causal_attention(q, kk.transpose(1, 2), vv.transpose(1, 2), enable_gqa=grouped)
        out.square().sum().backward()
        outs.append((out, q.grad, k.grad, v.grad))
    (out, dq, dk, dv), (out_r, dq_r, dk_r, dv_r) = outs
    assert torch.equal(out, out_r) and torch.equal(dq, dq_r)
    # dK/dV: the two chunks' sums, in another order than repeat_kv's head sum
    torch.testing.assert_close(dk, dk_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dv, dv_r, rtol=1e-6, atol=1e-6)
