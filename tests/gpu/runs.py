"""What the GPU checks (tests/gpu/) run and read: the Trainer on one device, the losses
it logged, a dispatch-level count of the matmul and attention kernels a pass ran, by dtype, and
the host syncs of its training steps."""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_amp.config import load_config
from torchtitan_amp.observability.host_syncs import StepSyncs
from torchtitan_amp.train.trainer import Trainer

BF16 = ["--mixed_precision.param_dtype", "bfloat16"]
MOE = ["--model.name", "moe", "--model.flavor", "debugmodel_moe"]
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm")


class OpDtypes(TorchDispatchMode):
    """Counts (op, dtype of its first tensor argument) for matmuls and attention kernels (SDPA's
    flash / efficient / cuDNN / CPU variants and their backward ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in _MATMULS or "attention" in name:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None:
                self.seen[f"{name}:{str(first.dtype).removeprefix('torch.')}"] += 1
        return func(*args, **(kwargs or {}))


def base_args(a: argparse.Namespace, dump: Path) -> list[str]:
    # --tiny proves the plumbing, not the numbers: the smallest flavor keeps a CPU without native
    # bf16 (AVX2, where bf16 matmuls are emulated) at ~0.05 s a step.
    shape = (
        ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2"]
        if a.tiny
        else ["--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size", "8"]
    )
    return [
        *shape,
        "--training.device",
        a.device,
        "--training.steps",
        str(a.steps),
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--job.dump_folder",
        str(dump),
    ]


def records(dump: Path) -> dict[int, dict[str, Any]]:
    """The last metrics record of each step (a resumed run appends)."""
    return {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def losses(dump: Path) -> dict[int, float]:
    """Each step's loss; a non-finite one (null in metrics.jsonl) as inf, so that it fails a bound."""
    return {s: math.inf if r["loss"] is None else r["loss"] for s, r in records(dump).items()}


def train(args: list[str]) -> Trainer:
    trainer = Trainer(load_config(args))
    trainer.train()
    trainer.run.metrics.close()
    return trainer


def free_memory() -> None:
    """Between runs: a finished Trainer's tensors (and an interrupted one's) go before the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def moe_combine_repeats(device: str) -> dict[str, bool]:
    """An MoE layer (8 experts, top 4, a shared expert) run forward and backward twice on the same
    input after a warm-up run, per dtype: whether outputs and every gradient are bit-identical
    across the two (the combine sums a token's k rows in a fixed order; fp32 index_add_ on CUDA
    adds them in a run-dependent one). The warm-up takes first-call effects (kernel selection,
    lazily made caches) out of the comparison."""
    from torchtitan_amp.models.moe.moe import MoE

    same = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        layer = MoE(64, 64, 8, 4, 1, "softmax", False, 1.0, "bias", 0.0, 1e-3).to(device)
        layer.init_weights(0.02)
        layer = layer.to(dtype)
        x = torch.randn(4, 256, 64, device=device, dtype=dtype)
        runs = []
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out = layer(xi)
            out.float().square().sum().backward()
            runs.append([out.detach(), xi.grad, *(p.grad for p in layer.parameters() if p.grad is not None)])
        same[str(dtype).removeprefix("torch.")] = all(torch.equal(u, v) for u, v in zip(*runs[1:]))
    return same


# Ops by the kernel rules.attention_kernel predicts for a lower-right causal call.
_LOWER_RIGHT_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_efficient_attention_forward",
    "cpu_flash": "_scaled_dot_product_flash_attention_for_cpu",
}


class MadeShapes(TorchDispatchMode):
    """Records the attention ops that ran (with their key's head count) and every tensor an op
    made whose last two dims are one of `shapes` (a chunk's [n, end]: a mask or its scores)."""

    def __init__(self, shapes: set[tuple[int, int]]) -> None:
        super().__init__()
        self.shapes, self.ops, self.made = shapes, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if "attention" in name and "backward" not in name:
            key = args[1] if "efficient_attention_forward" not in name else args[1].transpose(1, 2)
            self.ops[f"{name}:kv_heads={key.shape[1]}"] += 1
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) in self.shapes:
                self.made[f"{name}:{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}"] += 1
        return out


def cp_chunk_attention(device: str, dtype: torch.dtype, head_dim: int, tiny: bool) -> dict[str, Any]:
    """Causal attention of context parallel's rank 1 of 4 (ContextParallel.causal_attention: two
    query chunks, each against its prefix of the window with a lower-right causal bias), forward
    and backward on `device`, without a process group (the keys stand for the gathered window),
    shaped like Llama 3 8B (32 heads, 8 kv heads; --tiny: 4 and 2) and handing K/V grouped or
    repeated as the model does. What ran, against what rules.attention_kernel predicts."""
    from torchtitan_amp.core.rules import attention_kernel, materialises_causal_mask, takes_grouped_kv
    from torchtitan_amp.distributed.context_parallel import ContextParallel
    from torchtitan_amp.models.llama3.model import _DTYPE_NAMES, repeat_kv

    cp, rank = 4, 1
    heads, kv_heads, seq = (4, 2, 64) if tiny else (32, 8, 8192)
    name = _DTYPE_NAMES[dtype]
    grouped = takes_grouped_kv(device, name, head_dim, "causal")
    rank_cp = type("Rank", (ContextParallel,), {"degree": cp, "rank": rank})(group=None)  # type: ignore[arg-type]
    n = seq // (2 * cp)
    q = torch.randn(1, heads, 2 * n, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, seq, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "kv")
    kk, vv = (k, v) if grouped else (repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads))
    rank_cp.prepare_causal(2 * n, q.device)  # the biases, made outside the recorder
    shapes = {(n, (chunk + 1) * n) for chunk in rank_cp._chunks()}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with MadeShapes(shapes) as seen:
        out = rank_cp.causal_attention(q, kk.transpose(1, 2), vv.transpose(1, 2), enable_gqa=grouped)
        out.float().square().sum().backward()
    kernel = attention_kernel(device, name, head_dim, "causal")
    return {
        "dtype": name,
        "head_dim": head_dim,
        "kernel_predicted": kernel,
        "grouped_kv": grouped,
        "ops": dict(seen.ops),
        "chunk_shaped_tensors": dict(seen.made),
        "mask_predicted": materialises_causal_mask(device, name, head_dim),
        "expected_op_ran": any(op.startswith(_LOWER_RIGHT_OPS.get(kernel, "?") + ":") for op in seen.ops),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
    }


# trainer.train_step's one device read (the finiteness flag), on one device without EP, dense or MoE.
STEP_SYNC_BUDGET = 1


class _CudaSyncWarnings:
    """Wraps a trainer's train_step: with torch.cuda.set_sync_debug_mode("warn") on, CUDA itself
    reports every synchronizing call (what the dispatcher count cannot see: a blocking copy made
    inside an op, a stream sync in a library). Per step of `only`: the warnings' first lines."""

    def __init__(self, trainer: Trainer, only: set[int]) -> None:
        self.per_step: dict[int, list[str]] = {}
        step_fn = trainer.train_step

        def warned(*args: Any, **kwargs: Any) -> Any:
            if trainer.step not in only:
                return step_fn(*args, **kwargs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return step_fn(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    self.per_step[trainer.step] = [
                        str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)
                    ]

        trainer.train_step = warned


class StepTimes:
    """Wraps a trainer's train_step (outermost, so that its device sync is in no count): per
    step, the seconds train_step took until the device finished it, and, under per-step fault
    tolerance, the seconds of the quorum just before it (FaultTolerance.quorum_s), the groups in
    it and the steps discarded so far."""

    def __init__(self, trainer: Trainer) -> None:
        self.per_step: dict[int, dict[str, float]] = {}
        step_fn = trainer.train_step
        sync = torch.cuda.synchronize if trainer.run.device.type == "cuda" else (lambda: None)

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return step_fn(*args, **kwargs)
            finally:
                sync()
                record = {"train_step_s": time.perf_counter() - begin}
                if trainer.run.ft is not None:
                    record.update(
                        quorum_s=trainer.run.ft.quorum_s,
                        participants=trainer.run.ft.participants,
                        discarded=trainer.run.ft.discarded,
                    )
                self.per_step[trainer.step] = record

        trainer.train_step = timed


def step_syncs(
    args: list[str],
    budget: int = STEP_SYNC_BUDGET,
    setup: Callable[[Trainer], Any] | None = None,
    counted: set[int] | None = None,
) -> dict[str, Any]:
    """Train; for each step of `counted` (default: every step after the first, which builds
    lazily): the host syncs counted at the dispatcher (host_syncs.StepSyncs, with the line of
    each) and, on CUDA, the synchronizing calls CUDA's sync debug mode reported inside
    train_step. "step_times": every step's StepTimes record (a counted step's seconds include the
    counting's own cost: time the others). `setup(trainer)` runs on the built Trainer before it
    trains (e.g. attaches expert parallel)."""
    trainer = Trainer(load_config(args))
    if setup is not None:
        setup(trainer)
    counted = set(range(2, trainer.config.training.steps + 1)) if counted is None else counted
    recorder = StepSyncs(only=counted, where=True)
    recorder.install(trainer)
    cuda = _CudaSyncWarnings(trainer, counted) if trainer.run.device.type == "cuda" else None
    times = StepTimes(trainer)
    trainer.train()
    recorder.finish()
    trainer.run.metrics.close()
    steps = {s: {**r, "cuda_sync_warnings": cuda.per_step.get(s) if cuda else None} for s, r in recorder.steps.items()}
    return {"budget": budget, "steps": steps, "step_times": times.per_step}


def sync_budget_kept(result: dict[str, Any]) -> bool:
    """Every counted step's train_step within its budget, at the dispatcher and (CUDA) by CUDA."""
    steps = result["steps"].values()
    return bool(steps) and all(
        max(r["train_step"], len(r["cuda_sync_warnings"] or ())) <= result["budget"] for r in steps
    )


def mm_out_dtype(device: str) -> dict[str, Any]:
    """torch.mm of bf16 inputs with an fp32 output (the router gate's cheap form): whether this
    device runs it, and its distance from the fp32 product of the same bf16 values."""
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(512, 256, device=device, generator=g).bfloat16()
    w = torch.randn(64, 256, device=device, generator=g).bfloat16()
    try:
        got = torch.mm(x, w.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return {"ran": False, "error": " ".join(str(e).splitlines())[:200]}
    ref = x.double() @ w.double().t()
    return {
        "ran": True,
        "dtype": str(got.dtype).removeprefix("torch."),
        "max_rel_diff_vs_fp64": float(((got.double() - ref).abs().max() / ref.abs().max()).item()),
    }
