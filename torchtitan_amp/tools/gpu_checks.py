#!/usr/bin/env python3
"""The checks the CPU test suite cannot make, for one CUDA GPU in one short call (~2-3 minutes).

    python -m torchtitan_amp.tools.gpu_checks --json $OUT/gpu_checks.json          # on the GPU machine
    python -m torchtitan_amp.tools.gpu_checks --device cpu --tiny                  # the same code path on CPU

Everything runs in this one process (one CUDA start-up), through the real Trainer:

- `probe`    one bf16 autocast forward + backward on CUDA: the dtype every nn.Linear returns, what
             RMSNorm computes in and returns, the logits' dtype at the loss, the dtype of every
             matmul-type op in forward and in backward (CUDA's autocast op lists, not CPU's), and
             fp32 parameters and gradients.
- `curves`   N steps of the debug model in fp32, bf16 autocast, fp16 + GradScaler and bf16 +
             torch.compile; max |loss - fp32 loss| per precision against a stated tolerance.
- `resume`   checkpoint.async_mode = async_with_pinned_mem (CUDA only): a run resumed from its
             step-3 checkpoint must reproduce steps 4..6 bit for bit (==).
- `fp8`      torchao float8 (tensorwise) against bf16: 200 steps' loss curve, the precision audit
             of one fp8 step, and the step time of an 8B-shaped 2-block stack in bf16 and fp8.

Multi-rank checks (nccl compress hook, FSDP on CUDA) need two GPUs: NCCL refuses two ranks on one
device. Exit 0 when every check passes, 1 otherwise; each check prints one PASS/FAIL line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from torchtitan_amp.environment import require, separate_inductor_cache  # noqa: E402

require()
separate_inductor_cache()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from torchtitan_amp import trainer as trainer_module  # noqa: E402
from torchtitan_amp.config import load_config  # noqa: E402
from torchtitan_amp.models.llama import RMSNorm  # noqa: E402
from torchtitan_amp.parallelize import parallel_context  # noqa: E402
from torchtitan_amp.trainer import Trainer, loss_fn  # noqa: E402

# Max |loss - fp32 loss| over the run: the CPU suite's bound for bf16 (measured 0.0019 over 30
# steps there); fp16 with a scaler sits closer to fp32, compile only reorders bf16 arithmetic.
TOLERANCE = {"bf16": 0.01, "fp16": 0.01, "bf16_compile": 0.01}
PRECISIONS = {
    "fp32": ["--mixed_precision.enabled", "false"],
    "bf16": ["--mixed_precision.param_dtype", "bfloat16"],
    "fp16": ["--mixed_precision.param_dtype", "float16"],
    "bf16_compile": ["--mixed_precision.param_dtype", "bfloat16", "--compile.enable"],
}
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul")


class _OpDtypes(TorchDispatchMode):
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
    shape = (["--model.flavor", "debugmodel_h64", "--training.seq_len", "32", "--training.local_batch_size", "2"]
             if a.tiny else ["--model.flavor", "debugmodel", "--training.seq_len", "256",
                             "--training.local_batch_size", "8"])
    return [*shape, "--training.device", a.device, "--training.steps", str(a.steps), "--metrics.log_freq", "1",
            "--lr_scheduler.warmup_steps", "2", "--job.dump_folder", str(dump)]


def losses(dump: Path) -> dict[int, float]:
    """The last record of each step (a resumed run appends)."""
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def train(args: list[str]) -> Trainer:
    trainer = Trainer(load_config(args))
    trainer.train()
    trainer.metrics.close()
    return trainer


def check_probe(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    trainer = Trainer(load_config(base_args(a, work / "probe") + PRECISIONS["bf16"]))
    linear_out: Counter[str] = Counter()
    norm_io: Counter[str] = Counter()
    hooks = []
    for module in trainer.model.modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(
                lambda m, i, o: linear_out.update([str(o.dtype).removeprefix("torch.")])))
        elif isinstance(module, RMSNorm):
            hooks.append(module.register_forward_hook(
                lambda m, i, o: norm_io.update([f"in {i[0].dtype} out {o.dtype}".replace("torch.", "")])))
    inputs, labels = next(iter(trainer.dataloader))
    inputs, labels = inputs.to(trainer.device), labels.to(trainer.device)
    forward, backward = _OpDtypes(), _OpDtypes()
    with parallel_context(trainer.dims, trainer.config), trainer.plan.forward_context(), forward:
        logits = trainer.plan.cast_output(trainer.model(inputs))
        loss = loss_fn(logits, labels)
    with trainer.plan.backward_context(), backward:
        loss.backward()
    for h in hooks:
        h.remove()
    param_dtypes = {str(p.dtype) for p in trainer.model.parameters()}
    grad_dtypes = {str(p.grad.dtype) for p in trainer.model.parameters() if p.grad is not None}
    trainer.metrics.close()
    low = "bfloat16"
    fwd_low = all(k.endswith(low) for k in forward.seen)
    bwd_low = all(k.endswith(low) for k in backward.seen)
    ok = (set(linear_out) == {low} and bool(forward.seen) and fwd_low and bool(backward.seen) and bwd_low
          and str(logits.dtype) == "torch.float32" and param_dtypes == grad_dtypes == {"torch.float32"})
    # RMSNorm's input may be bf16 (a Linear's output) but it computes and returns fp32 or the input
    # dtype per the fp32-island rule; record it rather than guess.
    return {"ok": ok, "linear_out": dict(linear_out), "rms_norm": dict(norm_io), "forward_ops": dict(forward.seen),
            "backward_ops": dict(backward.seen), "logits": str(logits.dtype), "params": sorted(param_dtypes),
            "grads": sorted(grad_dtypes)}


def check_curves(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    curves, seconds = {}, {}
    for name, extra in PRECISIONS.items():
        begin = time.perf_counter()
        train(base_args(a, work / name) + extra)
        seconds[name] = round(time.perf_counter() - begin, 2)
        curves[name] = losses(work / name)
    ref = curves["fp32"]
    diffs = {name: max(abs(c[s] - ref[s]) for s in ref) for name, c in curves.items() if name != "fp32"}
    ok = all(d <= TOLERANCE[n] for n, d in diffs.items()) and all(len(c) == a.steps for c in curves.values())
    return {"ok": ok, "max_abs_diff_vs_fp32": diffs, "tolerance": TOLERANCE, "final_loss":
            {n: c[max(c)] for n, c in curves.items()}, "wall_s": seconds}


def check_resume(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    mode = "async_with_pinned_mem" if a.device == "cuda" else "async"
    extra = [*PRECISIONS["bf16"], "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
             "--checkpoint.async_mode", mode]
    first, second = work / "resume_a", work / "resume_b"
    train(base_args(a, first) + extra)
    shutil.copytree(first / "checkpoint" / "step-3", second / "checkpoint" / "step-3")
    train(base_args(a, second) + extra)
    la, lb = losses(first), losses(second)
    ok = sorted(lb) == [4, 5, 6] and all(lb[s] == la[s] for s in lb)
    return {"ok": ok, "async_mode": mode, "uninterrupted": la, "resumed": lb}


# fp8 (e4m3, 3 mantissa bits) against bf16 over the fp8 curve: measured on CPU (tiny, 30 steps)
# <= 2e-3; torchao reports fp8 curves within ~1e-2 of bf16 on Llama pre-training.
FP8_TOLERANCE = 0.05
FP8 = ["--mixed_precision.param_dtype", "bfloat16", "--mixed_precision.fp8", "tensorwise"]


def _step_seconds(args: list[str], steps: int) -> float:
    """Median step time of a short run after its first (warm-up) step."""
    trainer = Trainer(load_config([*args, "--training.steps", str(steps)]))
    batches, times = iter(trainer.dataloader), []
    for _ in range(steps):
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        sync()
        begin = time.perf_counter()
        trainer.train_step(batches)
        sync()
        times.append(time.perf_counter() - begin)
    trainer.metrics.close()
    return sorted(times[1:])[len(times[1:]) // 2]


def check_fp8(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """fp8 (torchao tensorwise) against bf16: the loss curve, the precision audit of one step, and
    tokens/s of an 8B-shaped stack of 2 blocks (seq 2048; --tiny: the debug shape)."""
    from torchtitan_amp.models import llama

    steps = a.steps if a.tiny else max(a.steps, 200)
    curves = {}
    for name, extra in (("bf16", PRECISIONS["bf16"]), ("fp8", FP8)):
        train(base_args(a, work / f"fp8_{name}") + extra + ["--training.steps", str(steps)])
        curves[name] = losses(work / f"fp8_{name}")
    diff = max(abs(curves["fp8"][s] - curves["bf16"][s]) for s in curves["bf16"])
    audit = Trainer(load_config(base_args(a, work / "fp8_audit") + FP8)).audit()
    if a.tiny:
        shape = base_args(a, work / "fp8_speed")
    else:
        llama.LLAMA3_FLAVORS["llama3_8b_2l"] = dataclasses.replace(llama.LLAMA3_FLAVORS["llama3_8b"], n_layers=2)
        shape = ["--model.flavor", "llama3_8b_2l", "--training.seq_len", "2048", "--training.local_batch_size", "2",
                 "--training.device", a.device, "--job.dump_folder", str(work / "fp8_speed")]
    timed_steps = 3 if a.tiny else 6
    seconds = {name: _step_seconds([*shape, *extra], timed_steps)
               for name, extra in (("bf16", PRECISIONS["bf16"]), ("fp8", FP8))}
    ok = diff <= FP8_TOLERANCE and audit.ok and len(curves["fp8"]) == steps
    return {"ok": ok, "steps": steps, "max_abs_diff_vs_bf16": diff, "tolerance": FP8_TOLERANCE,
            "final_loss": {n: c[max(c)] for n, c in curves.items()}, "audit_ok": audit.ok,
            "audit_breaches": [str(b) for b in audit.breaches], "step_s": seconds,
            "fp8_speedup": seconds["bf16"] / seconds["fp8"], "speed_shape": "tiny" if a.tiny else "llama3_8b x 2 blocks"}


CHECKS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "probe": check_probe, "curves": check_curves, "resume": check_resume, "fp8": check_fp8}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU trial run)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma list from {', '.join(CHECKS)}")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    unknown = set(a.only.split(",")) - set(CHECKS)
    if unknown:
        p.error(f"--only: unknown check {sorted(unknown)[0]!r}; choose from {', '.join(CHECKS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --tiny for a trial run)")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    # MFU's CPU peak measurement runs an fp16 GEMM that takes minutes on CPUs without fp16 units.
    if a.device == "cpu":
        trainer_module.peak_flops = lambda device, dtype: 1e12
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"}
    print(json.dumps(env), flush=True)
    results: dict[str, Any] = {"env": env}
    with tempfile.TemporaryDirectory(prefix="gpu_checks_") as tmp:
        for name in a.only.split(","):
            begin = time.perf_counter()
            try:
                results[name] = CHECKS[name](a, Path(tmp))
            except Exception as e:  # noqa: BLE001 - report and go on to the next check
                results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            results[name]["seconds"] = round(time.perf_counter() - begin, 1)
            print(f"{'PASS' if results[name]['ok'] else 'FAIL'} {name}: {json.dumps(results[name])}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for k, r in results.items() if k != "env") else 1


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
