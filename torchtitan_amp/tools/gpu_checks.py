#!/usr/bin/env python3
"""The checks the CPU test suite cannot make, for one CUDA GPU in one short call (~3.5 minutes).

    python -m torchtitan_amp.tools.gpu_checks --json $OUT/gpu_checks.json --time-budget 200   # GPU
    python -m torchtitan_amp.tools.gpu_checks --device cpu --tiny                            # CPU trial

Everything runs in this one process (one CUDA start-up; fault_tolerance's two replica groups are
processes of their own), cheap first in CUDA_LIMITS_S's order (each check's cap), all but
fp8_speed by default:

- `kernels`    which SDPA op a bf16 causal call runs, non-grouped and grouped, under the model's
               pinned order and torch's own, and the cuDNN version (pass: the pinned calls run
               what rules.attention_kernel predicts); torchao's shipped and loaded extensions
               and whether torch.ops.torchao.mxfp8_quantize exists; one fp8 rowwise
               torch._scaled_mm (pass on compute capability 8.9+: it runs).
- `fsdp_hook`  a 1-rank process group (nccl): a fully_shard model whose all-reduce hook issues
               its collective ~50 ms late on a side stream; pass: gradients equal no hook's.
- `block_scaled_kernels` see gpu_check_blockscaled.py (cuBLAS's reduced-precision bf16
               reduction off while it runs).

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
- `syncs`      host syncs per training step of the debug and MoE debug models in bf16 (one
               device, no EP): counted at the dispatcher and reported by CUDA's sync debug mode.
               Pass: each step after the first within STEP_SYNC_BUDGET (the finiteness read).
- `block_scaled_syncs` the same for the debug model in emulated mxfp8 and nvfp4 (the full recipe);
               `ep_syncs` for the MoE debug model with expert parallel's dispatch and combine on a
               1-rank process group (nccl; budget + one read per EP layer): gpu_check_syncs.py.
- `fault_tolerance` two 1-rank torchft replica groups (processes, on this device, a lighthouse on
               loopback): step time with and without fault tolerance, quorum seconds, host syncs
               per step: gpu_check_ft.py.
- `generate`   a 3-step-trained debug model (its q and k scaled by 8, so that positions matter)
               decodes 24 tokens greedily with its KV cache on this device: pass when every step's logits equal one full forward over the text (fp32
               within GENERATE_ATOL, bf16 within GENERATE_BF16_REL of the largest logit) and each
               fp32 token is that forward's argmax; decode tokens/s recorded.
- `fp8`        torchao float8 (tensorwise) against bf16: 200 steps' loss curve (pass: within
               FP8_TOLERANCE) and the precision audit of one fp8 step (pass: no breach).
- `cp_attention` context parallel's causal chunk attention (rank 1 of 4, 8B's heads, window 8192)
               in bf16 and fp32, forward + backward: pass when the kernel rules.attention_kernel
               predicts ran (flash with grouped K/V, efficient) and no [n, end] tensor (mask or
               scores) was made on CUDA (CPU builds its masks by design); head_dim 260 recorded.
- `fp8_speed`  step time of an 8B-shaped 2-block stack (seq 2048), bf16 and fp8, both compiled as
               torchao needs (--tiny: the tiny shape, eager). Pass on CUDA: fp8 is faster. Not
               in the default selection (--only fp8_speed).

The --json file is rewritten (atomically) when each check starts and ends; each check has a status:
"passed", "failed", "error" (it raised), "timeout" (over its limit: SIGALRM), "killed" (SIGTERM,
e.g. the outer `timeout`), "running" (the process died during it), "skipped" (torchao missing:
fp8, fp8_speed, block_scaled_kernels; torchft missing: fault_tolerance) or "not run". A check's
limit is the smaller of its cap (CUDA_LIMITS_S, or --check-timeout) and what --time-budget leaves;
each records `compile_s`, its seconds in torch.compile (cold on a fresh machine).

Multi-rank checks (nccl compress hook, FSDP on CUDA) need two GPUs: NCCL refuses two ranks on one
device. Exit 0 when every check passes, 1 otherwise; each check prints one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import importlib.util
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torchtitan_amp.core.environment import require, separate_inductor_cache  # noqa: E402

require()
separate_inductor_cache()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchtitan_amp.config import load_config  # noqa: E402
from torchtitan_amp.distributed.process_groups import CUBLAS_DETERMINISTIC_WORKSPACE  # noqa: E402
from torchtitan_amp.distributed.tensor_parallel import parallel_context  # noqa: E402
from torchtitan_amp.models.llama3 import model as llama  # noqa: E402
from torchtitan_amp.models.llama3.model import RMSNorm  # noqa: E402
from torchtitan_amp.precision import autocast  # noqa: E402
from torchtitan_amp.train import trainer as trainer_module  # noqa: E402
from torchtitan_amp.train import build as train_build  # noqa: E402
from torchtitan_amp.tools.gpu_check_blockscaled import block_scaled_kernels  # noqa: E402
from torchtitan_amp.tools.gpu_check_ft import check_fault_tolerance  # noqa: E402
from torchtitan_amp.tools.gpu_check_probes import check_fsdp_hook, check_kernels  # noqa: E402
from torchtitan_amp.tools.gpu_check_runner import Check, Report, run_all  # noqa: E402
from torchtitan_amp.tools.gpu_check_runs import (  # noqa: E402
    BF16, MOE, OpDtypes, base_args, cp_chunk_attention, free_memory, losses, mm_out_dtype, moe_combine_repeats,
    records, step_syncs, sync_budget_kept, train)
from torchtitan_amp.tools.gpu_check_syncs import (  # noqa: E402
    COUNTED_RUN_STEPS, check_block_scaled_syncs, check_ep_syncs)
from torchtitan_amp.train.trainer import Trainer, loss_fn  # noqa: E402

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

# Per-check caps on CUDA, from estimates (no GPU run yet): the debug model's steps take
# milliseconds there; compilation (bf16_compile in curves, the compiled speed runs), process and
# NCCL start-ups and Trainer builds (~1 s each) dominate. About twice each check's expected time:
# a handful of ops (cp_attention, block_scaled_kernels) 5 s; one Trainer and a step (probe) or
# two 3-step runs and decoding (generate) 10 s; two 4-step counted runs (syncs,
# block_scaled_syncs) 6 s, ep_syncs 8 s with its NCCL start-up; fault_tolerance's two group
# processes (a Python, torch and CUDA start-up each, side by side, then 2 x 12 steps) 15 s.
# In the order the checks run: the cheap probes first, so that a short call still reaches them.
CUDA_LIMITS_S = {"kernels": 10.0, "fsdp_hook": 10.0, "probe": 10.0, "cp_attention": 5.0,
                 "block_scaled_kernels": 5.0, "syncs": 6.0, "block_scaled_syncs": 6.0, "ep_syncs": 8.0,
                 "generate": 10.0, "resume": 20.0, "moe": 15.0, "fault_tolerance": 15.0, "fp8": 30.0,
                 "curves": 50.0, "fp8_speed": 150.0}
# What runs without --only: every check but fp8_speed (two compiled 8B-shaped runs; ask for it with
# --only fp8_speed, e.g. on a rerun that skips the MFU benchmark). Its caps sum to DEFAULT_BUDGET_S
# or less (tests/test_gpu_checks.py), scripts/gpu_run.sh's default --time-budget.
DEFAULT_CHECKS = [name for name in CUDA_LIMITS_S if name != "fp8_speed"]
DEFAULT_BUDGET_S = 200.0
# Checks that import an optional package: skipped (the others run) where it is not importable.
NEEDS = {"fp8": "torchao", "fp8_speed": "torchao", "block_scaled_kernels": "torchao", "fault_tolerance": "torchft"}


# ---------------------------------------------------------------------------------------------
# Checks: each fills `out` as it goes (what it has survives a timeout) and returns whether it passed


def check_probe(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    trainer = Trainer(load_config(base_args(a, work) + BF16))
    linear_out: Counter[str] = Counter()
    norm_io: Counter[str] = Counter()
    hooks = []
    for module in trainer.run.model.modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(
                lambda m, i, o: linear_out.update([str(o.dtype).removeprefix("torch.")])))
        elif isinstance(module, RMSNorm):
            hooks.append(module.register_forward_hook(
                lambda m, i, o: norm_io.update([f"in {i[0].dtype} out {o.dtype}".replace("torch.", "")])))
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
    out.update(linear_out=dict(linear_out), rms_norm=dict(norm_io), forward_ops=dict(forward.seen),
               backward_ops=dict(backward.seen), logits=str(logits.dtype), params=sorted(param_dtypes),
               grads=sorted(grad_dtypes))
    low = "bfloat16"
    ops_low = all(bool(ops.seen) and all(k.endswith(low) for k in ops.seen) for ops in (forward, backward))
    return (set(linear_out) == {low} and ops_low and str(logits.dtype) == "torch.float32"
            and param_dtypes == grad_dtypes == {"torch.float32"})


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
    out.update(tolerance=TOLERANCE, wall_s={}, final_loss={}, max_abs_diff_vs_fp32={}, skipped_steps={},
               compared="step-aligned: a run k updates behind (skipped fp16 steps) is held to the fp32 "
                        "losses of the k steps before")
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
    return (all(d <= TOLERANCE[n] for n, d in out["max_abs_diff_vs_fp32"].items())
            and all(len(c) == a.steps for c in curves.values()))


@contextmanager
def determinism_restored() -> Iterator[None]:
    """training.deterministic switches torch process-wide; later checks (speed) must not inherit it."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def resume_pair(a: argparse.Namespace, work: Path, mode: str, deterministic: bool) -> tuple[dict, dict]:
    """(uninterrupted losses, losses of a run resumed from the first one's step-3 checkpoint)."""
    # Logged every 2 steps: the step-3 save happens on a step that logs nothing (no loss read).
    extra = [*BF16, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
             "--checkpoint.async_mode", mode, "--training.deterministic", str(deterministic).lower(),
             "--metrics.log_freq", str(RESUME_LOG_FREQ)]
    first, second = work / f"a_{deterministic}", work / f"b_{deterministic}"
    with determinism_restored():
        trainer = train(base_args(a, first) + extra)
        SAVE_FACTS.update(save_s=trainer.run.checkpointer.last_save_s, bytes=sum(
            f.stat().st_size for f in (first / "checkpoint" / "step-3").rglob("*") if f.is_file()))
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
        out.update(deterministic=False, deterministic_error=" ".join(str(e).splitlines())[:300],
                   compared=f"step 4 bitwise, step 6 within {RESUME_NONDETERMINISTIC_TOL}")
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
    return (out["max_abs_diff_vs_fp32"] <= TOLERANCE["bf16"] and all(len(c) == a.steps for c in curves.values())
            and (out["router"] or {}).get("router_dtype") == "float32"
            and all(out["combine_bitwise_across_runs"].values())
            and (grouped_ran or not (a.device == "cuda" and grouped["bfloat16"])))


def check_syncs(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    for name, extra in (("dense", BF16), ("moe", [*MOE, *BF16])):
        out[name] = step_syncs(base_args(a, work / name) + extra + ["--training.steps", str(COUNTED_RUN_STEPS)])
        free_memory()
    return sync_budget_kept(out["dense"]) and sync_budget_kept(out["moe"])


def _cached_step_logits(runner: Any, tokens: list[int], device: torch.device) -> torch.Tensor:
    """Prefill PROMPT, then feed tokens[len(PROMPT):-1] one at a time through the KV cache: the
    logits after every position from len(PROMPT) - 1 on."""
    from torchtitan_amp.eval.generation import kv_caches, step_logits

    def ids(t: list[int]) -> torch.Tensor:
        return torch.tensor([t], device=device)

    with torch.no_grad(), kv_caches(runner.model, len(tokens) + runner.multiple) as caches:
        steps = [step_logits(runner, ids(PROMPT), caches)]
        steps += [step_logits(runner, ids([t]), caches) for t in tokens[len(PROMPT):-1]]
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
            full = runner.cast_output(model(torch.tensor([tokens], device=trainer.run.device)))[0, len(PROMPT) - 1:-1]
        full = full.float()
        err = float((_cached_step_logits(runner, tokens, trainer.run.device) - full).abs().max())
        largest = float(full.abs().max())
        greedy = full.argmax(dim=-1).tolist() == completion.tokens
        out[name] = {"max_abs_logit_diff": err, "max_abs_logit": largest, "greedy_matches_full_forward": greedy,
                     "tokens_per_s": round(new / seconds, 1)}
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
        shape = ["--model.flavor", SPEED_FLAVOR, "--training.seq_len", "2048", "--training.local_batch_size", "2",
                 "--training.device", a.device, "--job.dump_folder", str(work)]
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
    out.update(shape="tiny" if a.tiny else f"llama3_8b x 2 blocks ({SPEED_FLAVOR}), seq 2048 x batch 2",
               compile=compiled, step_s={})
    steps, warmup = (3, 1) if a.tiny else (10, 3)
    for name, args in configs.items():
        out["step_s"][name] = step_seconds([*args], steps, warmup)
    out["fp8_speedup"] = out["step_s"]["bf16"] / out["step_s"]["fp8"]
    # CPU fp8 is no fast path: there the check only proves that the runs work.
    return out["fp8_speedup"] > 1.0 or a.device != "cuda"


def check_cp_attention(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    hd = 32 if a.tiny else 128
    cases = [(torch.bfloat16, hd), (torch.float32, hd)] + ([(torch.bfloat16, 260)] if a.device == "cuda" else [])
    passed = True
    for dtype, head_dim in cases:
        r = out[f"{dtype}_hd{head_dim}".removeprefix("torch.")] = cp_chunk_attention(a.device, dtype, head_dim, a.tiny)
        if r["kernel_predicted"] != "math":  # math (head_dim 260): what config validation refuses
            passed &= r["expected_op_ran"] and bool(r["chunk_shaped_tensors"]) == r["mask_predicted"]
    return passed


_BY_NAME: dict[str, Check] = {
    "kernels": check_kernels, "fsdp_hook": check_fsdp_hook, "probe": check_probe, "cp_attention": check_cp_attention,
    "block_scaled_kernels": lambda a, work, out: block_scaled_kernels(a.device, out), "syncs": check_syncs,
    "block_scaled_syncs": check_block_scaled_syncs, "ep_syncs": check_ep_syncs, "generate": check_generate,
    "resume": check_resume, "moe": check_moe, "fault_tolerance": check_fault_tolerance, "fp8": check_fp8,
    "curves": check_curves, "fp8_speed": check_fp8_speed}
CHECKS: dict[str, Check] = {name: _BY_NAME[name] for name in CUDA_LIMITS_S}  # in running order


def unavailable(name: str) -> str | None:
    """Why check `name` cannot run in this Python (a package it imports is missing), or None."""
    package = NEEDS.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"{package} is not importable: carry its wheels in .whl/ (docs/performance.md, \"GPU checks\")"
    return None


def environment(a: argparse.Namespace) -> dict[str, Any]:
    cuda = a.device == "cuda"
    try:
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "torchao": torchao,
            "python": platform.python_version(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "tiny": a.tiny, "steps": a.steps,
            "time_budget_s": a.time_budget}


# ---------------------------------------------------------------------------------------------
# Command line


def _limits(text: str) -> dict[str, float]:
    """--check-timeout curves=60,fp8=30 -> {"curves": 60.0, "fp8": 30.0}."""
    limits = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, _, seconds = item.partition("=")
        if name not in CHECKS:
            raise argparse.ArgumentTypeError(f"unknown check {name!r}; choose from {', '.join(CHECKS)}")
        try:
            limits[name] = float(seconds)
        except ValueError:
            limits[name] = math.nan
        if not limits[name] > 0:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=SECONDS with SECONDS > 0")
    return limits


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU trial run)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", default=",".join(DEFAULT_CHECKS),
                   help=f"comma list from {', '.join(CHECKS)} (default: all but fp8_speed), run in that order")
    p.add_argument("--json", type=Path, help="write the results here (rewritten as each check starts and ends)")
    p.add_argument("--time-budget", type=float, help="seconds for all checks; each check's limit is cut to "
                   "what is left, and one is not started with under 5 s left (default: no budget)")
    p.add_argument("--check-timeout", type=_limits, default={}, metavar="NAME=S[,NAME=S]",
                   help="a check's own limit (CUDA default: " + ", ".join(f"{k} {v:.0f} s" for k, v in
                                                                            CUDA_LIMITS_S.items()) + "; CPU: none)")
    a = p.parse_args(argv)
    unknown = set(a.only.split(",")) - set(CHECKS)
    if unknown:
        p.error(f"--only: unknown check {sorted(unknown)[0]!r}; choose from {', '.join(CHECKS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --tiny for a trial run)")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    # Before the first CUDA matmul: cuBLAS sizes its workspace once per process, and the resume
    # check runs with training.deterministic = true, which needs this setting (torch's notes).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    # MFU's CPU peak measurement runs an fp16 GEMM that takes minutes on CPUs without fp16 units.
    if a.device == "cpu":
        train_build.peak_flops = lambda device, dtype: 1e12
    names = [n for n in CHECKS if n in a.only.split(",")]  # cheap first, whatever order was asked
    report = Report(a.json, environment(a), names)
    print(json.dumps(report.data["env"]), flush=True)
    report.write()
    run_all(a, report, names, CHECKS, CUDA_LIMITS_S, unavailable)
    report.data["finished"] = True
    report.write()
    return 0 if report.passed() else 1


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
