"""The GPU checks' cheap probes, each a few seconds on a GPU: which SDPA kernel the model's attention
runs (pinned and left to torch) and the cuDNN version, torchao's loaded extensions and its MXFP8
op, one fp8 rowwise torch._scaled_mm, the FSDP all-reduce-hook hazard (a hook whose all-reduce
runs late on its own stream must leave the gradients as no hook does), and context parallel's
chunk attention kernels."""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.gpu.runs import cp_chunk_attention
from torchtitan_amp.core.rules import attention_kernel
from torchtitan_amp.models.attention import cuda_capability, pinned_kernels

pytestmark = pytest.mark.gpu

# The forward op each kernel rules.attention_kernel names runs as, for a plain causal call.
KERNEL_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cpu_flash": "_scaled_dot_product_flash_attention_for_cpu",
    "math": "_softmax",
}


class _AttentionOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if "attention" in name or name == "_softmax":
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def _sdpa_ops(device: str, kv_heads: int, pinned: bool, head_dim: int = 128) -> dict[str, int]:
    """The attention ops of one bf16 causal forward + backward (4 query heads, `kv_heads` kv heads
    handed grouped), under the model's pinned order or torch's own."""
    q = torch.randn(1, 4, 256, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, kv_heads, 256, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
    )
    ops = _AttentionOps()
    context = pinned_kernels() if pinned else torch.enable_grad()
    with ops, context:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4).float().sum().backward()
    return dict(ops.seen)


def sdpa_probe(device: str) -> dict[str, Any]:
    """Which SDPA op ran for a non-grouped and a grouped bf16 causal call, pinned (what the model
    runs) and left to torch, against rules.attention_kernel; and the cuDNN version."""
    capability = cuda_capability() if device == "cuda" else None
    predicted = attention_kernel(device, "bfloat16", 128, "causal", capability)
    runs = {
        f"{what}_{'pinned' if pinned else 'torch_order'}": _sdpa_ops(device, kv, pinned)
        for what, kv in (("non_grouped", 4), ("grouped", 2))
        for pinned in (True, False)
    }
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    expected = KERNEL_OPS[predicted]
    pinned_ok = all(expected in ops for name, ops in runs.items() if name.endswith("_pinned"))
    return {
        "predicted": predicted,
        "expected_op": expected,
        "runs": runs,
        "cudnn_version": cudnn,
        "pinned_runs_predicted_op": pinned_ok,
    }


def torchao_probe() -> dict[str, Any]:
    """torchao's version, the extension libraries it ships and those torch loaded, and whether the
    MXFP8 quantize op (torch.ops.torchao.mxfp8_quantize, a CUDA extension) is registered."""
    spec = importlib.util.find_spec("torchao")
    if spec is None or spec.origin is None:
        return {"importable": False}
    import torchao

    folder = Path(spec.origin).parent
    shipped = sorted(p.name for p in folder.glob("_C*.so"))
    loaded = sorted(Path(p).name for p in torch.ops.loaded_libraries if str(folder) in str(p))
    return {
        "importable": True,
        "version": getattr(torchao, "__version__", None),
        "shipped": shipped,
        "loaded": loaded,
        "mxfp8_quantize_op": hasattr(torch.ops.torchao, "mxfp8_quantize"),
    }


def check_kernels(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    """The probes no training run needs: SDPA op and cuDNN version, torchao's extensions, one fp8
    rowwise torch._scaled_mm. Pass: the pinned SDPA runs the predicted op, and on a CUDA GPU of
    compute capability 8.9+ the rowwise _scaled_mm runs."""
    from torchtitan_amp.precision.lowbit import capability

    out["sdpa"] = sdpa_probe(a.device)
    out["torchao"] = torchao_probe()
    out["fp8_rowwise_scaled_mm"] = capability.fp8_matmul_unsupported(a.device, "rowwise") or "ran"
    fp8_expected = a.device != "cuda" or torch.cuda.get_device_capability() >= (8, 9)
    return out["sdpa"]["pinned_runs_predicted_op"] and (out["fp8_rowwise_scaled_mm"] == "ran" or not fp8_expected)


# ---------------------------------------------------------------------------------------------
# The FSDP all-reduce hook


def one_rank_group(device: str) -> None:
    """A 1-rank default process group in this process (nccl on CUDA, gloo on CPU), once."""
    if dist.is_initialized():
        return
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="gpu_checks_pg_"), "store"), 1)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=store,
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0) if device == "cuda" else None,
    )


def _hooked_grads(device: str, delay: bool) -> list[torch.Tensor]:
    """Gradients of a 2-layer bf16-reduced fully_shard model on the 1-rank group after one
    backward; `delay`: with an all-reduce hook whose collective is issued on a side stream after
    a ~50 ms spin (the shape of a cross-group all-reduce that is late), then waited on."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    side = torch.cuda.Stream() if device == "cuda" else None

    def hook(grad: torch.Tensor) -> None:
        if side is None:
            dist.all_reduce(grad)
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            work = dist.all_reduce(grad, async_op=True)
        work.wait()

    if delay:
        for m in (model[0], model[2], model):
            m.set_all_reduce_hook(hook)
    x = torch.randn(64, 256, device=device)
    model(x).square().sum().backward()
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def check_fsdp_hook(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    """The hazard of FSDP's all-reduce hook (fault tolerance's cross-group all-reduce): a hook
    whose all-reduce runs late on another stream must still be what the optimizer reads. On one
    rank the all-reduce is the identity: pass when the gradients equal no hook's bit for bit."""
    one_rank_group(a.device)
    try:
        plain, hooked = _hooked_grads(a.device, False), _hooked_grads(a.device, True)
    finally:  # the Trainer-based checks after this one expect no process group in this process
        dist.destroy_process_group()
    same = [torch.equal(x, y) for x, y in zip(plain, hooked)]
    out.update(params=len(same), bitwise_equal=all(same), backend="nccl" if a.device == "cuda" else "gloo")
    return all(same) and len(same) == 4


def check_cp_attention(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    hd = 32 if a.tiny else 128
    cases = [(torch.bfloat16, hd), (torch.float32, hd)] + ([(torch.bfloat16, 260)] if a.device == "cuda" else [])
    passed = True
    for dtype, head_dim in cases:
        r = out[f"{dtype}_hd{head_dim}".removeprefix("torch.")] = cp_chunk_attention(a.device, dtype, head_dim, a.tiny)
        if r["kernel_predicted"] != "math":  # math (head_dim 260): what config validation refuses
            passed &= r["expected_op_ran"] and bool(r["chunk_shaped_tensors"]) == r["mask_predicted"]
    return passed


def test_kernels(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_kernels(a, tmp_path, out), out


def test_fsdp_hook(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_fsdp_hook(a, tmp_path, out), out


def test_cp_attention(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_cp_attention(a, tmp_path, out), out
