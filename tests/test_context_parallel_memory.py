"""Context parallel's memory on the attention kernels, in one process: which SDPA kernel a call
runs (rules.attention_kernel), grouped K/V where the kernel takes them (no repeated copy saved),
the start-up refusal where CUDA would build a causal mask, every attention op CP can run in the
selective-AC save list, and no per-forward gather of positions or document ids that are known.
The bytes a CP block saves against the memory model: tests/test_dry_run.py
(test_activation_formula_matches_saved_tensors, with a fake process group)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from torchtitan_amp.core.rules import attention_kernel, materialises_causal_mask, takes_grouped_kv
from torchtitan_amp.distributed.context_parallel import (
    ContextParallel,
    gathered_positions,
    head_tail_positions,
)
from torchtitan_amp.models.llama3 import model as llama
from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer, repeat_kv


@pytest.mark.parametrize(
    "device, dtype, head_dim, mask, kernel",
    [
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
    ],
)
def test_attention_kernel_by_device_dtype_head_dim_and_mask(
    device: str, dtype: str, head_dim: int, mask: str, kernel: str
) -> None:
    assert attention_kernel(device, dtype, head_dim, mask) == kernel


@pytest.mark.parametrize(
    "capability, head_dim, training, kernel",
    [
        ((9, 0), 200, True, "flash"),
        ((10, 0), 128, True, "flash"),
        ((8, 9), 200, True, "efficient"),  # consumer parts: flash refuses training at head_dim (192, 224]
        ((12, 0), 224, True, "efficient"),
        ((8, 6), 200, False, "flash"),  # inference is taken
        ((8, 9), 232, True, "flash"),  # past 224 without dropout: taken
        ((7, 5), 128, True, "efficient"),  # below sm80: no flash
    ],
)
def test_attention_kernel_by_compute_capability(
    capability: tuple[int, int], head_dim: int, training: bool, kernel: str
) -> None:
    assert attention_kernel("cuda", "bfloat16", head_dim, "causal", capability, training) == kernel
    assert takes_grouped_kv("cuda", "bfloat16", head_dim, "causal", capability, training) == (kernel == "flash")


def test_the_models_attention_runs_under_the_pinned_kernel_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SDPA call of the model's attention (plain causal, a KV cache, context parallel's
    chunks) runs with cuDNN attention off and flash, efficient, math first, in that order: the
    order rules.attention_kernel predicts (torch would put cuDNN first on sm90 / sm100)."""
    from torch.nn.attention import SDPBackend

    original, seen = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch._C._get_sdp_priority_order()[:3]))
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = _gqa_model()
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    pinned = [int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.MATH)]
    assert seen == [(False, pinned)] * 2, seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call


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
    methods = {"degree": cp, "rank": rank, "gather_kv": lambda self, x: torch.cat([x] * cp, dim=1)}
    return type("Rank", (ContextParallel,), methods)(group=None)  # type: ignore[arg-type]


def _gqa_model(layers: int = 2, seq: int = 32) -> Transformer:
    args = LlamaModelArgs(
        dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=seq
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def _loss_and_grads(
    model: Transformer, tokens: torch.Tensor, **extra: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(tokens, **extra).float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
@pytest.mark.parametrize("cp", [1, 2])
def test_grouped_kv_is_bitwise_the_repeated_one_in_fp32(
    monkeypatch: pytest.MonkeyPatch, cp: int, mask_type: str
) -> None:
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
    shapes = _saved_shapes(
        model, torch.randint(0, 64, (2, seq // cp)), positions=head_tail_positions(seq, cp, 1).expand(2, -1)
    )
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


def test_sharder_hands_the_window_documents_in_the_keys_gathered_order() -> None:
    """kv_doc_ids on every rank is what an all-gather of the ranks' doc_ids would give: rank 0's
    chunks first (the order gather_kv lays keys out); positions follow from the shape."""
    from torchtitan_amp.distributed.context_parallel import BatchSharder
    from torchtitan_amp.models.attention import MaskInputs

    cp, seq = 4, 32
    torch.manual_seed(0)
    inputs = torch.randint(0, 8, (2, seq))
    inputs[:, ::7] = 256  # BOS: several documents per window
    sharded = [BatchSharder(MaskInputs("block_causal", 256, 257), cp, r)(inputs, inputs) for r in range(cp)]
    gathered_docs = torch.cat([extra["doc_ids"] for _, _, extra in sharded], dim=1)
    gathered_pos = torch.cat([extra["positions"] for _, _, extra in sharded], dim=1)
    for _, _, extra in sharded:
        assert torch.equal(extra["kv_doc_ids"], gathered_docs)
    assert torch.equal(gathered_pos[0], gathered_positions(seq, cp))
    assert torch.equal(_cp_rank(cp, 1).key_positions(seq // cp, torch.device("cpu")), gathered_positions(seq, cp))
    assert "kv_doc_ids" not in BatchSharder(MaskInputs("causal", 256, 257), cp, 1)(inputs, inputs)[2]


@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_cp_forward_gathers_keys_and_values_only(monkeypatch: pytest.MonkeyPatch, mask_type: str) -> None:
    """One forward of a CP 2 rank (a fake process group) all-gathers K and V per block and nothing
    else: no positions, no document ids (block_causal gathered both every forward before)."""
    from torchtitan_amp.distributed import context_parallel as cp_mod
    from torchtitan_amp.distributed.context_parallel import BatchSharder
    from torchtitan_amp.models.attention import MaskInputs
    from torchtitan_amp.train import dry_run

    gathered: list[torch.dtype] = []
    gather = cp_mod.collectives()[0]

    def record(x: torch.Tensor, dim: int, group: object) -> torch.Tensor:
        gathered.append(x.dtype)
        return gather(x, dim, group)

    monkeypatch.setattr(cp_mod, "_ALL_GATHER", record)
    cp, seq, layers = 2, 32, 2
    created = dry_run.init_fake_process_group(cp, 1)
    try:
        model = _gqa_model(layers)
        cp_mod.apply_cp(model, ContextParallel(torch.distributed.group.WORLD))
        tokens = torch.randint(0, 64, (2, seq))
        inputs, _, extra = BatchSharder(MaskInputs(mask_type, 256, 257), cp, 1)(tokens, tokens)
        model(inputs, **extra)
    finally:
        if created:
            torch.distributed.destroy_process_group()
    assert gathered == [torch.float32] * 2 * layers


def _attention_ops(*args: Any, **kwargs: Any) -> set:
    """The aten attention ops `F.scaled_dot_product_attention(*args, **kwargs)` dispatches
    (forward), as OpOverloads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if "attention" in func.name():
                seen.add(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        F.scaled_dot_product_attention(*args, **kwargs)
    return seen


def test_every_attention_kernel_cp_can_run_is_saved_by_op_level_sac() -> None:
    """On this CPU: causal, CP's lower-right bias and an explicit bool mask, in fp32 and bf16, with
    grouped and repeated K/V, dispatch ops in activation_checkpoint.SAC_SAVE_LIST. On CUDA the lower-right
    bias calls its kernels by name (torch.nn.attention.bias): each of those names is in it too
    (the efficient one, _efficient_attention_forward, was missing: op-level SAC recomputed CP's
    fp32 attention in backward)."""
    import inspect
    import re

    from torch.nn.attention.bias import CausalBias

    from torchtitan_amp.distributed.activation_checkpoint import SAC_SAVE_LIST
    from torchtitan_amp.distributed.context_parallel import lower_right_causal

    n, end = 8, 24
    seen = set()
    for dtype in (torch.float32, torch.bfloat16):
        for kv_heads in (4, 2):
            q = torch.randn(2, 4, n, 16, dtype=dtype)
            k, v = torch.randn(2, kv_heads, end, 16, dtype=dtype), torch.randn(2, kv_heads, end, 16, dtype=dtype)
            gqa = kv_heads != 4
            mask = torch.ones(n, end, dtype=torch.bool).tril(end - n)
            seen |= _attention_ops(q, k[:, :, :n], v[:, :, :n], is_causal=True, enable_gqa=gqa)
            seen |= _attention_ops(q, k, v, attn_mask=lower_right_causal(n, end), enable_gqa=gqa)
            seen |= _attention_ops(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert seen and seen <= SAC_SAVE_LIST, seen - SAC_SAVE_LIST
    named = set(re.findall(r"torch\.ops\.aten\.(\w+)\(", inspect.getsource(CausalBias._dispatch)))
    assert named == {"_scaled_dot_product_flash_attention", "_efficient_attention_forward"}, named
    assert {getattr(torch.ops.aten, name).default for name in named} <= SAC_SAVE_LIST


def test_cp_causal_that_would_build_a_mask_on_cuda_is_refused_in_one_line() -> None:
    from torchtitan_amp.config import ConfigError
    from torchtitan_amp.distributed.context_parallel import check_causal_kernel

    check_causal_kernel("cuda", "bfloat16", 128, 8, "x")  # flash
    check_causal_kernel("cuda", "float32", 128, 8, "x")  # efficient
    check_causal_kernel("cpu", "float32", 6, 8, "x")  # CPU builds its chunk masks by design
    check_causal_kernel("cuda", "float32", 6, 1, "x")  # no CP: plain causal, not this check's
    with pytest.raises(ConfigError) as err:
        check_causal_kernel("cuda", "bfloat16", 260, 2, "mixed_precision.param_dtype, model.flavor 'f'")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(
        "'parallelism.context_parallel_degree' = 2 with causal attention on cuda in "
        "bfloat16 at head_dim 260 (mixed_precision.param_dtype, model.flavor 'f')"
    )


def test_dry_run_refuses_cp_causal_that_cuda_would_run_with_a_mask(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Through the trainer's checks (job.resolve): a dry run sizes GPUs, so it asks CUDA's kernels;
    a flavor with head_dim 6 in fp32 has neither (efficient needs a multiple of 4); block_causal
    and CP 1 are not refused."""
    from torchtitan_amp.config import ConfigError, load_config
    from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS
    from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS
    from torchtitan_amp.train import dry_run

    monkeypatch.setitem(
        LLAMA3_FLAVORS, "head_dim_6", dataclasses.replace(LLAMA3_FLAVORS["debugmodel_tiny"], dim=24, n_heads=4)
    )
    base = [
        "--model.flavor",
        "head_dim_6",
        "--mixed_precision.enabled",
        "false",
        "--training.seq_len",
        "64",
        "--job.dump_folder",
        str(tmp_path),
        "--dry_run.vocab_size",
        "258",
    ]
    with pytest.raises(ConfigError, match=r"in float32 at head_dim 6 \(training.dtype, model.flavor 'head_dim_6'\)"):
        dry_run.resolve(load_config([*base, "--parallelism.context_parallel_degree", "2"]), 2)
    dry_run.resolve(
        load_config([*base, "--parallelism.context_parallel_degree", "2", "--model.attn_mask_type", "block_causal"]), 2
    )
    dry_run.resolve(load_config(base), 1)
    # gpt-oss under CP computes its own fp32 softmax over the gathered keys (sinks, windows): no
    # SDPA call takes the bias there, so the same head_dim 6 in fp32 is not refused.
    monkeypatch.setitem(
        GPT_OSS_FLAVORS, "head_dim_6", dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], explicit_head_dim=6)
    )
    gpt_oss = ["--model.name", "gpt_oss", *base, "--parallelism.context_parallel_degree", "2"]
    assert dry_run.resolve(load_config(gpt_oss), 2).layout.cp == 2
