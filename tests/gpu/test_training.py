"""The GPU checks that train the debug models through the real Trainer on one device (the others:
test_device_ops.py, test_block_scaled_kernels.py, test_syncs.py, test_ft_groups.py; the whole list, in
running order, with caps and pass criteria: docs/performance.md, "GPU checks"):

- `probe`      one bf16 autocast forward + backward: the dtype every nn.Linear returns, what
               RMSNorm takes and returns, the logits' dtype, the dtype of every matmul / attention
               op in forward and backward (CUDA's autocast op lists, not CPU's), fp32 parameters
               and gradients. Pass: all of it as the bf16 autocast plan promises.
- `curves`     N steps of the debug model in fp32, bf16 autocast, fp16 + GradScaler and bf16 +
               torch.compile. Pass: every loss within TOLERANCE of fp32's, step-aligned (a step
               fp16's scaler skipped puts that run one update behind; see aligned_diff).
- `resume`     checkpoint.async_mode = async_with_pinned_mem (CUDA), training.deterministic = true,
               logging every 2 steps: a run resumed from its step-3 checkpoint (saved on a step
               that logs nothing) reproduces logged steps 4 and 6 bit for bit; the save's
               seconds and bytes recorded.
- `moe`        the MoE family (debugmodel_moe): fp32 and bf16 curves (pass: bf16 within TOLERANCE
               of fp32, routers in fp32), which expert matmul ran (pass on CUDA where the probe
               says the grouped kernel works: `_grouped_mm` in bf16), and, measured only, torch.mm
               with bf16 inputs and fp32 output (`out_dtype`: the cheaper router gate matmul, not
               built until it is measured here).
- `generate`   a 3-step-trained debug model (its q and k scaled by 8, so that positions matter)
               decodes 24 tokens greedily with its KV cache on this device: pass when every step's
               logits equal one full forward over the text (fp32 within GENERATE_ATOL, bf16 within
               GENERATE_BF16_REL of the largest logit) and each fp32 token is that forward's
               argmax; decode tokens/s recorded.
- `fp8`        torchao float8 (tensorwise) against bf16: 200 steps' loss curve (pass: within
               FP8_TOLERANCE) and the precision audit of one fp8 step (pass: no breach).
- `fp8_speed`  step time of an 8B-shaped 2-block stack (seq 2048), bf16 and fp8, both compiled as
               torchao needs (tiny: the tiny shape, eager). Pass on CUDA: fp8 is faster. Runs with
               GPU_CHECKS_SPEED=1 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.gpu.runs import (
    BF16,
    MOE,
    OpDtypes,
    base_args,
    free_memory,
    losses,
    mm_out_dtype,
    moe_combine_repeats,
    records,
    train,
)
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed.tensor_parallel import parallel_context
from torchtitan_amp.models.llama3 import model as llama
from torchtitan_amp.models.llama3.model import RMSNorm
from torchtitan_amp.precision import autocast
from torchtitan_amp.train.trainer import Trainer, loss_fn

pytestmark = pytest.mark.gpu

# Max |loss - fp32 loss| over the run: the CPU suite's bound for bf16 (measured 0.0019 over 30
# steps there); fp16 with a scaler sits closer to fp32, compile only reorders bf16 arithmetic.
TOLERANCE = {"bf16": 0.01, "fp16": 0.01, "bf16_compile": 0.01}
PRECISIONS = {
    "fp32": ["--mixed_precision.enabled", "false"],
    "bf16": BF16,
    "fp16": ["--mixed_precision.param_dtype", "float16"],
    "bf16_compile": [*BF16, "--compile.enable"],
}
# fp8 (e4m3, 3 mantissa bits) against bf16 over the fp8 curve: measured on CPU (--tiny, 30 steps)
# 3.1e-3; torchao reports fp8 curves within ~1e-2 of bf16 on Llama pre-training.
FP8_TOLERANCE = 0.05
FP8 = [*BF16, "--mixed_precision.fp8", "tensorwise"]
# Without deterministic kernels (an op torch has none for): steps 5..6 follow a backward whose
# atomics may add in another order, so they may differ by rounding; a resume bug (optimizer state,
# schedule, data position) moves the loss by far more.
RESUME_NONDETERMINISTIC_TOL = 1e-3
RESUME_LOG_FREQ = 2
# The resume check's step-3 save (seconds from asking to commit, bytes on disk), filled as it runs.
SAVE_FACTS: dict[str, Any] = {}
SPEED_FLAVOR = "llama3_8b_2l"
# KV-cache decode against a full forward, fp32: the CPU suite measures 1.43e-6 on logits up to
# 4.1 (tests/test_generation.py bounds it by 1e-5); CUDA's attention kernels for one query row
# and for a whole matrix differ more in summation order: 1e-4 is still ~100 ulps of 4.0.
GENERATE_ATOL = 1e-4
# bf16 (8-bit mantissa): keys, values and activations round at 2^-8 relative.
GENERATE_BF16_REL = 0.05
PROMPT = [256, *b"Hello"]  # the byte tokenizer's BOS, then bytes


# ---------------------------------------------------------------------------------------------
# Checks: each fills `out` as it goes (what it has survives a timeout) and returns whether it passed


def check_probe(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    trainer = Trainer(load_config(base_args(a, work) + BF16))
    linear_out: Counter[str] = Counter()
    norm_io: Counter[str] = Counter()
    hooks = []
    for module in trainer.run.model.modules():
        if isinstance(module, nn.Linear):
            hooks.append(
                module.register_forward_hook(lambda m, i, o: linear_out.update([str(o.dtype).removeprefix("torch.")]))
            )
        elif isinstance(module, RMSNorm):
            hooks.append(
                module.register_forward_hook(
                    lambda m, i, o: norm_io.update([f"in {i[0].dtype} out {o.dtype}".replace("torch.", "")])
                )
            )
    inputs, labels = next(iter(trainer.run.dataloader))
    inputs, labels = inputs.to(trainer.run.device), labels.to(trainer.run.device)
    forward, backward = OpDtypes(), OpDtypes()
    with parallel_context(trainer.run.dims, trainer.config), autocast.forward_context(trainer.run.plan), forward:
        logits = autocast.cast_output(trainer.run.plan, trainer.run.model(inputs))
        loss = loss_fn(logits, labels)
    with autocast.backward_context(trainer.run.plan), backward:
        loss.backward()
    for h in hooks:
        h.remove()
    param_dtypes = {str(p.dtype) for p in trainer.run.model.parameters()}
    grad_dtypes = {str(p.grad.dtype) for p in trainer.run.model.parameters() if p.grad is not None}
    trainer.run.metrics.close()
    # RMSNorm's input may be bf16 (a Linear's output) but it computes and returns fp32 or the input
    # dtype per the fp32-island rule; recorded rather than guessed.
    out.update(
        linear_out=dict(linear_out),
        rms_norm=dict(norm_io),
        forward_ops=dict(forward.seen),
        backward_ops=dict(backward.seen),
        logits=str(logits.dtype),
        params=sorted(param_dtypes),
        grads=sorted(grad_dtypes),
    )
    low = "bfloat16"
    ops_low = all(bool(ops.seen) and all(k.endswith(low) for k in ops.seen) for ops in (forward, backward))
    return (
        set(linear_out) == {low}
        and ops_low
        and str(logits.dtype) == "torch.float32"
        and param_dtypes == grad_dtypes == {"torch.float32"}
    )


def skipped_before(recs: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Optimizer steps the loss scaler skipped before each step (metrics' cumulative skipped_steps
    is recorded after the step; runs without a scaler have none)."""
    return {s: int((recs.get(s - 1) or {}).get("skipped_steps") or 0) for s in recs}


def aligned_diff(ref: dict[int, float], curve: dict[int, float], behind: dict[int, int]) -> float:
    """Max over steps of the distance from curve[s] to the reference curve, step-aligned.

    fp16's GradScaler skips a step whose gradients overflow (typically the first steps, while the
    scale comes down) and holds the LR schedule: a run k updates behind at step s is compared with
    the band of reference losses over steps s-k..s. With k = 0 that is |curve[s] - ref[s]|."""
    worst = 0.0
    for s, loss in curve.items():
        band = [ref[t] for t in range(max(1, s - behind.get(s, 0)), s + 1) if t in ref]
        if not band:
            return math.inf
        worst = max(worst, min(band) - loss, loss - max(band))
    return worst


def check_curves(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    out.update(
        tolerance=TOLERANCE,
        wall_s={},
        final_loss={},
        max_abs_diff_vs_fp32={},
        skipped_steps={},
        compared="step-aligned: a run k updates behind (skipped fp16 steps) is held to the fp32 "
        "losses of the k steps before",
    )
    curves: dict[str, dict[int, float]] = {}
    for name, extra in PRECISIONS.items():
        begin = time.perf_counter()
        train(base_args(a, work / name) + extra)
        free_memory()
        out["wall_s"][name] = round(time.perf_counter() - begin, 2)
        curves[name], recs = losses(work / name), records(work / name)
        out["final_loss"][name] = curves[name][max(curves[name])]
        behind = skipped_before(recs)
        out["skipped_steps"][name] = int(recs[max(recs)].get("skipped_steps") or 0)
        if name != "fp32":
            out["max_abs_diff_vs_fp32"][name] = aligned_diff(curves["fp32"], curves[name], behind)
    return all(d <= TOLERANCE[n] for n, d in out["max_abs_diff_vs_fp32"].items()) and all(
        len(c) == a.steps for c in curves.values()
    )


@contextmanager
def determinism_restored() -> Iterator[None]:
    """training.deterministic switches torch process-wide; later checks (speed) must not inherit it."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def resume_pair(a: argparse.Namespace, work: Path, mode: str, deterministic: bool) -> tuple[dict, dict]:
    """(uninterrupted losses, losses of a run resumed from the first one's step-3 checkpoint)."""
    # Logged every 2 steps: the step-3 save happens on a step that logs nothing (no loss read).
    extra = [
        *BF16,
        "--training.steps",
        "6",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.async_mode",
        mode,
        "--training.deterministic",
        str(deterministic).lower(),
        "--metrics.log_freq",
        str(RESUME_LOG_FREQ),
    ]
    first, second = work / f"a_{deterministic}", work / f"b_{deterministic}"
    with determinism_restored():
        trainer = train(base_args(a, first) + extra)
        SAVE_FACTS.update(
            save_s=trainer.run.checkpointer.last_save_s,
            bytes=sum(f.stat().st_size for f in (first / "checkpoint" / "step-3").rglob("*") if f.is_file()),
        )
        del trainer
        shutil.copytree(first / "checkpoint" / "step-3", second / "checkpoint" / "step-3")
        train(base_args(a, second) + extra)
    return losses(first), losses(second)


def check_resume(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    """Bitwise with training.deterministic = true, the step-3 save on a step that logs nothing
    (logged: 1, 2, 4, 6). Should torch have no deterministic kernel for an op, the run is repeated
    without: step 4 (a forward from the restored weights) must still match bit for bit, step 6
    within RESUME_NONDETERMINISTIC_TOL. The step-3 save's seconds (ask to commit) and bytes are
    recorded (pinned memory on CUDA)."""
    mode = "async_with_pinned_mem" if a.device == "cuda" else "async"
    out.update(async_mode=mode, deterministic=True, compared="bitwise (==), logged steps 4, 6", save=SAVE_FACTS)
    SAVE_FACTS.clear()
    try:
        la, lb = resume_pair(a, work, mode, deterministic=True)
    except RuntimeError as e:
        if "determinis" not in str(e):
            raise
        out.update(
            deterministic=False,
            deterministic_error=" ".join(str(e).splitlines())[:300],
            compared=f"step 4 bitwise, step 6 within {RESUME_NONDETERMINISTIC_TOL}",
        )
        la, lb = resume_pair(a, work, mode, deterministic=False)
    out.update(uninterrupted=la, resumed=lb)
    if sorted(lb) != [4, 6]:
        return False
    tol = 0.0 if out["deterministic"] else RESUME_NONDETERMINISTIC_TOL
    return lb[4] == la[4] and abs(lb[6] - la[6]) <= tol


def check_moe(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    from torchtitan_amp.core.torch_compat import grouped_mm_supported

    grouped = {d: grouped_mm_supported(a.device, getattr(torch, d)) for d in ("bfloat16", "float32")}
    out.update(grouped_mm_supported=grouped, tolerance=TOLERANCE["bf16"], final_loss={}, expert_ops={})
    curves = {}
    for name, extra in (("fp32", PRECISIONS["fp32"]), ("bf16", BF16)):
        ops = OpDtypes()
        with ops:
            train(base_args(a, work / name) + MOE + extra)
        free_memory()
        curves[name] = losses(work / name)
        out["final_loss"][name] = curves[name][max(curves[name])]
        out["expert_ops"][name] = {k: v for k, v in ops.seen.items() if k.startswith(("_grouped_mm", "mm:", "bmm"))}
    out["max_abs_diff_vs_fp32"] = max(abs(curves["bf16"][s] - curves["fp32"][s]) for s in curves["fp32"])
    out["router"] = json.loads((work / "bf16" / "precision_report.json").read_text()).get("router")
    out["mm_bf16_in_fp32_out"] = mm_out_dtype(a.device)
    out["combine_bitwise_across_runs"] = moe_combine_repeats(a.device)
    grouped_ran = any(k == "_grouped_mm:bfloat16" for k in out["expert_ops"]["bf16"])
    return (
        out["max_abs_diff_vs_fp32"] <= TOLERANCE["bf16"]
        and all(len(c) == a.steps for c in curves.values())
        and (out["router"] or {}).get("router_dtype") == "float32"
        and all(out["combine_bitwise_across_runs"].values())
        and (grouped_ran or not (a.device == "cuda" and grouped["bfloat16"]))
    )


def _cached_step_logits(runner: Any, tokens: list[int], device: torch.device) -> torch.Tensor:
    """Prefill PROMPT, then feed tokens[len(PROMPT):-1] one at a time through the KV cache: the
    logits after every position from len(PROMPT) - 1 on."""
    from torchtitan_amp.eval.generation import kv_caches, step_logits

    def ids(t: list[int]) -> torch.Tensor:
        return torch.tensor([t], device=device)

    with torch.no_grad(), kv_caches(runner.model, len(tokens) + runner.multiple) as caches:
        steps = [step_logits(runner, ids(PROMPT), caches)]
        steps += [step_logits(runner, ids([t]), caches) for t in tokens[len(PROMPT) : -1]]
    return torch.cat(steps)


def _sharpen_attention(model: nn.Module) -> None:
    """Scale q and k by 8: after 3 steps attention is near-uniform (scores ~0.03), and a cache that
    got positions wrong would barely show (tests/test_generation.py does the same)."""
    with torch.no_grad():
        for attention in (m for m in model.modules() if isinstance(m, llama.Attention)):
            attention.wq.weight.mul_(8)
            attention.wk.weight.mul_(8)


def check_generate(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    from torchtitan_amp.eval.generation import ModelRunner, generate

    new = 16 if a.tiny else 24
    ok = True
    for name, extra in (("fp32", PRECISIONS["fp32"]), ("bf16", BF16)):
        trainer = train(base_args(a, work / name) + extra + ["--training.steps", "3"])
        model = trainer.run.model.eval()
        _sharpen_attention(model)
        runner = ModelRunner.for_plan(model, trainer.run.plan, tp=1, sequence_parallel=False)
        sync = torch.cuda.synchronize if trainer.run.device.type == "cuda" else (lambda: None)
        sync()
        begin = time.perf_counter()
        completion = generate(runner, PROMPT, new)
        sync()
        seconds = time.perf_counter() - begin
        tokens = PROMPT + completion.tokens
        with torch.no_grad(), runner.forward_context():
            full = runner.cast_output(model(torch.tensor([tokens], device=trainer.run.device)))[0, len(PROMPT) - 1 : -1]
        full = full.float()
        err = float((_cached_step_logits(runner, tokens, trainer.run.device) - full).abs().max())
        largest = float(full.abs().max())
        greedy = full.argmax(dim=-1).tolist() == completion.tokens
        out[name] = {
            "max_abs_logit_diff": err,
            "max_abs_logit": largest,
            "greedy_matches_full_forward": greedy,
            "tokens_per_s": round(new / seconds, 1),
        }
        bound = GENERATE_ATOL if name == "fp32" else GENERATE_BF16_REL * largest
        ok = ok and err <= bound and (greedy or name != "fp32") and math.isfinite(largest)
        del trainer, model, runner
        free_memory()
    return ok


def check_fp8(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    """fp8 (torchao tensorwise) against bf16: the loss curve and the precision audit of one step."""
    steps = a.steps if a.tiny else max(a.steps, 200)
    out.update(steps=steps, tolerance=FP8_TOLERANCE, final_loss={})
    curves = {}
    for name, extra in (("bf16", BF16), ("fp8", FP8)):
        train(base_args(a, work / name) + extra + ["--training.steps", str(steps)])
        free_memory()
        curves[name] = losses(work / name)
        out["final_loss"][name] = curves[name][max(curves[name])]
    out["max_abs_diff_vs_bf16"] = max(abs(curves["fp8"][s] - curves["bf16"][s]) for s in curves["bf16"])
    audit = Trainer(load_config(base_args(a, work / "audit") + FP8)).audit()
    out.update(audit_ok=audit.ok, audit_breaches=[str(b) for b in audit.breaches])
    return out["max_abs_diff_vs_bf16"] <= FP8_TOLERANCE and audit.ok and len(curves["fp8"]) == steps


def speed_configs(a: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """The bf16 and fp8 speed runs' arguments: Llama 3 8B's block, 2 of them, seq 2048 x batch 2
    (registered as SPEED_FLAVOR), compiled on CUDA, since torchao's fp8 casts and scales are only
    fast fused by inductor (eager fp8 is slower than bf16). --tiny: the tiny shape."""
    if a.tiny:
        shape = base_args(a, work)
    else:
        llama.register_flavor(SPEED_FLAVOR, dataclasses.replace(llama.LLAMA3_FLAVORS["llama3_8b"], n_layers=2))
        shape = [
            "--model.flavor",
            SPEED_FLAVOR,
            "--training.seq_len",
            "2048",
            "--training.local_batch_size",
            "2",
            "--training.device",
            a.device,
            "--job.dump_folder",
            str(work),
        ]
    # CPU: inductor's C++ compilation would take minutes, and CPU fp8 is no fast path anyway.
    compiled = ["--compile.enable"] if a.device == "cuda" else []
    return {name: [*shape, *extra, *compiled] for name, extra in (("bf16", BF16), ("fp8", FP8))}


def step_seconds(args: list[str], steps: int, warmup: int) -> float:
    """Median step time of a short run after `warmup` untimed steps (compilation)."""
    trainer = Trainer(load_config([*args, "--training.steps", str(steps)]))
    sync = torch.cuda.synchronize if trainer.run.device.type == "cuda" else (lambda: None)
    batches, times = iter(trainer.run.dataloader), []
    for _ in range(steps):
        sync()
        begin = time.perf_counter()
        trainer.train_step(batches)
        sync()
        times.append(time.perf_counter() - begin)
    trainer.run.metrics.close()
    del trainer
    free_memory()
    timed = sorted(times[warmup:])
    return timed[len(timed) // 2]


def check_fp8_speed(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    configs = speed_configs(a, work)
    compiled = a.device == "cuda"
    out.update(
        shape="tiny" if a.tiny else f"llama3_8b x 2 blocks ({SPEED_FLAVOR}), seq 2048 x batch 2",
        compile=compiled,
        step_s={},
    )
    steps, warmup = (3, 1) if a.tiny else (10, 3)
    for name, args in configs.items():
        out["step_s"][name] = step_seconds([*args], steps, warmup)
    out["fp8_speedup"] = out["step_s"]["bf16"] / out["step_s"]["fp8"]
    # CPU fp8 is no fast path: there the check only proves that the runs work.
    return out["fp8_speedup"] > 1.0 or a.device != "cuda"


def test_probe(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_probe(a, tmp_path, out), out


def test_generate(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_generate(a, tmp_path, out), out


def test_resume(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_resume(a, tmp_path, out), out


def test_moe(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_moe(a, tmp_path, out), out


def test_fp8(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_fp8(a, tmp_path, out), out


def test_curves(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_curves(a, tmp_path, out), out


def test_fp8_speed(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_fp8_speed(a, tmp_path, out), out
