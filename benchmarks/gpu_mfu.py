#!/usr/bin/env python3
"""Throughput, MFU and peak memory of a Llama-3-8B-shaped model on one GPU: the bf16 FSDP policy
vs bf16 autocast vs fp32, each eager and compiled.

    python -m benchmarks.gpu_mfu                  # one CUDA GPU, fits in one 10-minute call
    benchmarks/gpu_mfu.sh                         # the same under `timeout`, JSON into $OUT
    python -m benchmarks.gpu_mfu --tiny           # CPU (or GPU) smoke run with a tiny shape

The model is Llama 3 8B's block (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256) with as
many layers as fit: the largest count whose torchtitan_amp.memory estimate (parameters, gradients,
AdamW state, activations) for the hungriest configuration stays under --mem-fraction of the GPU's
memory (an out-of-memory error still lowers the count by a quarter and retries). Every
configuration is built as the Trainer builds its model: a JobConfig (load_config with the
configuration's overrides: precision, --ac, compile), ParallelDims and its device mesh,
PrecisionPlan.from_config, then torchtitan_amp.train.job.build_model_parts
(parallelize_model: fp32 islands, activation checkpointing, torch.compile of each block, FSDP2
fully_shard with the plan's MixedPrecisionPolicy), and trained with loss_fn, clip_grad_norm_ and
build_optimizer (AdamW, fused on CUDA). On one GPU the FSDP "shard" is the whole model (a 1-rank
mesh): what is measured is the policy (bf16 gathered weights, fp32 master weights and gradients),
which torchtitan_amp otherwise applies only with >= 2 data-parallel ranks; the fsdp configuration
therefore declares FSDP enabled on its 1-rank dp_shard dim (ParallelDims below), and the planner
and parallelize_model take the FSDP path from there.

Reported per configuration: tokens/s/GPU, TFLOP/s, MFU against the GPU's bf16 dense peak (as
torchtitan: fp32 runs show what they leave unused), peak memory allocated / reserved, and the
warm-up time (compilation). fp32 matmuls run in true fp32 unless --tf32. A time budget
(--time-budget) skips configurations that would not finish; the JSON is rewritten after each one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from torchtitan_amp.core.environment import require, separate_inductor_cache

require()
separate_inductor_cache()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torchtitan_amp import memory  # noqa: E402
from torchtitan_amp.config import JobConfig, load_config  # noqa: E402
from torchtitan_amp.distributed.grad_norm import clip_grad_norm_  # noqa: E402
from torchtitan_amp.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, LlamaModelArgs  # noqa: E402
from torchtitan_amp.observability.metrics import peak_flops  # noqa: E402
from torchtitan_amp.precision import PrecisionPlan, autocast, memory_spec  # noqa: E402
from torchtitan_amp.train.job import Job, build_model_parts  # noqa: E402
from torchtitan_amp.train.optim import build_optimizer  # noqa: E402
from torchtitan_amp.train.trainer import loss_fn  # noqa: E402

LLAMA3_VOCAB = 128256
CONFIGS = {
    "fsdp": ("bf16 FSDP policy", ["--mixed_precision.param_dtype", "bfloat16"]),
    "autocast": ("bf16 autocast", ["--mixed_precision.param_dtype", "bfloat16"]),
    "fp32": ("fp32", ["--mixed_precision.enabled", "false"]),
}
# The precision path each configuration exists to measure (run_config checks that the plan took it).
EXPECTED_PATH = {"fsdp": "fsdp", "autocast": "autocast", "fp32": "full"}
GIB = 2**30


def model_args(a: argparse.Namespace, n_layers: int) -> LlamaModelArgs:
    if a.tiny:
        # The 8B block's features (GQA, FFN multiplier, scaled rope) at toy size.
        return LlamaModelArgs(
            dim=64,
            n_layers=n_layers,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=256,
            multiple_of=32,
            ffn_dim_multiplier=1.3,
            max_seq_len=a.seq_len,
        )
    return dataclasses.replace(
        LLAMA3_FLAVORS["llama3_8b"], n_layers=n_layers, vocab_size=LLAMA3_VOCAB, max_seq_len=a.seq_len
    )


def estimated_peak(args: LlamaModelArgs, a: argparse.Namespace, specs: list[memory.PrecisionSpec]) -> int:
    """The largest torchtitan_amp.memory peak estimate over the configurations' precision plans."""
    dims = memory.ModelDims.from_args(args)
    layout = memory.Layout(seq_len=a.seq_len, local_batch_size=a.batch, ac_mode=a.ac)
    return max(memory.estimate(dims, spec, layout).peak() for spec in specs)


def choose_layers(a: argparse.Namespace, device: torch.device, specs: list[memory.PrecisionSpec]) -> tuple[int, str]:
    if a.layers != "auto":
        return int(a.layers), "given by --layers"
    if a.tiny or device.type != "cuda":
        return 2, "tiny"
    total = torch.cuda.get_device_properties(device).total_memory
    budget = a.mem_fraction * total - 2 * GIB  # CUDA context, cuBLAS/compile workspaces
    best = 0
    for n in range(1, 33):
        if estimated_peak(model_args(a, n), a, specs) <= budget:
            best = n
    if best == 0:
        raise SystemExit(
            f"not even one 8B layer fits {a.mem_fraction:.0%} of {total / GIB:.0f} GiB at seq_len "
            f"{a.seq_len} x batch {a.batch}; lower --seq-len or use --ac full"
        )
    est = estimated_peak(model_args(a, best), a, specs)
    return best, (
        f"estimated peak {est / GIB:.1f} GiB <= {a.mem_fraction:.0%} of {total / GIB:.0f} GiB - 2 GiB "
        f"(torchtitan_amp.memory)"
    )


def init_process_group(device: torch.device) -> None:
    """A 1-rank group: FSDP2 needs a mesh even when it shards over one device."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )


class WholeModelShard(ParallelDims):
    """One rank with FSDP on: fully_shard over the 1-rank dp_shard dim. torchtitan_amp enables FSDP
    only with >= 2 shards (one GPU gets the autocast path); the benchmark measures the FSDP
    policy on one GPU, so this says FSDP is on and everything downstream (the planner's path,
    parallelize_model's FSDP and compile choices) follows as for a sharded run."""

    @property
    def fsdp_enabled(self) -> bool:
        return True


def job_config(name: str, compiled: bool, a: argparse.Namespace, device: torch.device) -> JobConfig:
    return load_config(
        [
            *CONFIGS[name][1],
            "--training.device",
            device.type,
            "--training.seq_len",
            str(a.seq_len),
            "--training.local_batch_size",
            str(a.batch),
            "--activation_checkpoint.mode",
            a.ac,
            "--compile.enable",
            "true" if compiled else "false",
        ]
    )


def parallel_dims(name: str, config: JobConfig, mesh: ParallelDims) -> ParallelDims:
    """ParallelDims.from_config on one rank, over the mesh main built once (a mesh per
    configuration would create new process groups each time)."""
    d = ParallelDims.from_config(config.parallelism, 1)
    cls = WholeModelShard if name == "fsdp" else ParallelDims
    return cls(
        d.dp_replicate,
        d.dp_shard,
        d.tp,
        d.pp,
        d.world_size,
        _mesh=mesh.mesh,
        _meshes={name: mesh.get_mesh(name) for name in ("dp", "fsdp", "loss")},
    )


def build_plan(
    name: str, compiled: bool, a: argparse.Namespace, device: torch.device, mesh: ParallelDims
) -> tuple[JobConfig, ParallelDims, PrecisionPlan]:
    """A configuration's JobConfig, ParallelDims and the PrecisionPlan the planner makes of them."""
    config = job_config(name, compiled, a, device)
    dims = parallel_dims(name, config, mesh)
    return config, dims, PrecisionPlan.from_config(config, dims, device.type)


def reset_memory(device: torch.device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return 0
    from torchtitan_amp.tools import estimate_memory

    estimate_memory.reset_peak_rss()
    return estimate_memory.rss_bytes()


def peak_memory(device: torch.device, baseline: int) -> tuple[float, float]:
    """(allocated, reserved) peak in GiB; on CPU the RSS growth since reset_memory, twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB
    from torchtitan_amp.tools import estimate_memory

    rss = (estimate_memory.peak_rss_bytes() - baseline) / GIB
    return rss, rss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_and_time(
    config: JobConfig,
    dims: ParallelDims,
    plan: PrecisionPlan,
    args: LlamaModelArgs,
    a: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """Builds the Trainer's model and optimizer, runs the untimed warm-up steps, then times up to
    --steps training steps; returns the step times (s), the warm-up time (s), the final loss, the
    parameter count and the FLOPs per token. Everything it builds (model, optimizer, batch, and the
    step closure over them) is freed when it returns, so that the caller's reset_memory releases it.

    Args:
        config: the configuration's JobConfig (optimizer, max_norm, compile and AC settings).
        dims: the configuration's ParallelDims on the shared 1-rank mesh.
        plan: the PrecisionPlan made of config and dims; it picks the forward/backward contexts.
        args: the model shape (layers, dim, vocabulary, sequence length).
        a: the parsed command line (batch, seq_len, warmup, steps, max_measure_s).
        device: where the model trains.
    """
    # The Trainer's model: built on meta, initialised (on CPU then moved, or on the device after
    # sharding), parallelize_model (fp32 islands, AC, compile, FSDP), in training mode.
    job = Job(config, dims.world_size, device.type, dims, 1, plan, None, args, (0,), 1, None)
    built = build_model_parts(job, device, [0])
    model = built.parts[0]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, config.optimizer, device)
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq_len + 1), device=device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> torch.Tensor:
        with autocast.forward_context(plan):
            loss = loss_fn(autocast.cast_output(plan, model(inputs)), labels)
        with autocast.backward_context(plan):
            loss.backward()
        clip_grad_norm_(params, config.training.max_norm, device=device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    start = time.perf_counter()
    for _ in range(a.warmup):
        step()
    sync(device)
    warmup_s = time.perf_counter() - start
    times: list[float] = []
    losses: list[torch.Tensor] = []
    measure_start = time.perf_counter()
    while len(times) < a.steps and (len(times) < 3 or time.perf_counter() - measure_start < a.max_measure_s):
        t0 = time.perf_counter()
        losses.append(step())
        sync(device)
        times.append(time.perf_counter() - t0)
    return {
        "times": times,
        "warmup_s": warmup_s,
        "final_loss": float(losses[-1]),
        "params": built.num_params,
        "flops_per_token": built.flops_per_token,
    }


def run_config(
    name: str, compiled: bool, n_layers: int, a: argparse.Namespace, device: torch.device, mesh: ParallelDims
) -> dict[str, Any]:
    """One configuration's measurement (a row of the table): its plan, checked to take the path the
    configuration exists to measure, then train_and_time and the peak memory of it.

    Args:
        name: the configuration, a key of CONFIGS (fsdp, autocast or fp32).
        compiled: whether each block runs under torch.compile.
        n_layers: transformer blocks in the model.
        a: the parsed command line.
        device: where the model trains.
        mesh: the 1-rank ParallelDims main built once; its meshes are reused.
    """
    config, dims, plan = build_plan(name, compiled, a, device, mesh)
    assert plan.path == EXPECTED_PATH[name], (name, plan.path)
    torch._dynamo.reset()
    baseline = reset_memory(device)
    run = train_and_time(config, dims, plan, model_args(a, n_layers), a, device)
    # Peaks, so the same after train_and_time freed what it built.
    allocated, reserved = peak_memory(device, baseline)
    reset_memory(device)
    times, fpt, final_loss = run["times"], run["flops_per_token"], run["final_loss"]
    step_s = sorted(times)[len(times) // 2]
    tps = a.batch * a.seq_len / step_s
    peak = peak_flops(device, [torch.bfloat16])
    return {
        "config": name,
        "precision": CONFIGS[name][0],
        "path": plan.path,
        "compile": compiled,
        "layers": n_layers,
        "params": run["params"],
        "flops_per_token": fpt,
        "step_s": step_s,
        "steps_timed": len(times),
        "tokens_per_s": tps,
        "tflops": tps * fpt / 1e12,
        "mfu_pct": 100 * tps * fpt / peak,
        "peak_flops": peak,
        "mem_allocated_gib": allocated,
        "mem_reserved_gib": reserved,
        "warmup_s": run["warmup_s"],
        "final_loss": final_loss,
        "loss_finite": math.isfinite(final_loss),
    }


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Rewritten after each configuration: written whole (tmp + rename), so that a timeout's kill
    never leaves half a file."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, target)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| precision | compile | layers | params | tokens/s/GPU | TFLOP/s | MFU | peak mem GiB (alloc / reserved) "
        "| warm-up s | loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {CONFIGS[r['config']][0]} | {'yes' if r['compile'] else 'no'} | {r.get('layers', '')} "
                f"| | {r['error']} | | | | | |"
            )
            continue
        lines.append(
            f"| {r['precision']} | {'yes' if r['compile'] else 'no'} | {r['layers']} | {r['params'] / 1e9:.2f}B "
            f"| {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {r['mfu_pct']:.1f}% "
            f"| {r['mem_allocated_gib']:.1f} / {r['mem_reserved_gib']:.1f} "
            f"| {r['warmup_s']:.0f} | {r['final_loss']:.3f} |"
        )
    return "\n".join(lines)


def run_with_retries(
    cfg: str, compiled: bool, layers: int, a: argparse.Namespace, device: torch.device, mesh: ParallelDims
) -> tuple[dict[str, Any], int]:
    """run_config, with the layer count cut by a quarter after an out-of-memory error (at most
    twice); (its result, an "error" entry if it failed, and the layer count it ended with)."""
    for attempt in range(3):
        error = None
        try:
            return run_config(cfg, compiled, layers, a, device, mesh), layers
        except Exception as e:
            error = (is_oom(e), f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")
        # Outside the except block: the traceback, which holds the failed run's tensors, is gone.
        reset_memory(device)
        oom, message = error
        if not (oom and layers > 1 and attempt < 2):
            break
        layers = max(1, layers * 3 // 4)
        print(f"  {cfg} compile={compiled}: out of memory, retrying with {layers} layers", flush=True)
    return {"config": cfg, "compile": compiled, "layers": layers, "error": message}, layers


def print_result(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"  {r['config']} compile={r['compile']}: FAILED {r['error']}", flush=True)
        return
    print(
        f"  {r['precision']:17s} compile={'on ' if r['compile'] else 'off'}: {r['tokens_per_s']:,.0f} tokens/s, "
        f"{r['tflops']:.1f} TFLOP/s, MFU {r['mfu_pct']:.1f}%, peak {r['mem_allocated_gib']:.1f} GiB "
        f"allocated, warm-up {r['warmup_s']:.0f} s, loss {r['final_loss']:.3f}",
        flush=True,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="toy shape (dim 64, 2 layers, seq 32): a smoke run, CPU or GPU")
    p.add_argument("--configs", default="fsdp,autocast,fp32", help="from fsdp, autocast, fp32 (in this order)")
    p.add_argument("--compile", default="off,on", help="off, on, or off,on (default: both, eager first)")
    p.add_argument(
        "--compile-configs", help="the configs that also run compiled when --compile has on (default: all of --configs)"
    )
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 8192; 32 with --tiny)")
    p.add_argument("--batch", type=int, help="sequences per step (default 1; 2 with --tiny)")
    p.add_argument("--layers", default="auto", help="transformer blocks, or 'auto': as many as fit")
    p.add_argument("--ac", default="none", choices=["none", "full"], help="activation checkpointing")
    p.add_argument("--steps", type=int, help="timed steps (default 10; 2 with --tiny)")
    p.add_argument("--warmup", type=int, help="untimed steps first, compilation included (default 3; 1 with --tiny)")
    p.add_argument("--max-measure-s", type=float, default=30.0, help="stop timing a config after this (>= 3 steps)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=500.0,
        help="skip configs that would start after "
        "this many seconds minus their expected duration (default %(default)s)",
    )
    p.add_argument("--mem-fraction", type=float, default=0.85, help="share of GPU memory --layers auto may plan for")
    p.add_argument("--tf32", action="store_true", help="let fp32 matmuls use TF32 tensor cores")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (rewritten after each config)")
    a = p.parse_args(argv)
    tiny = a.tiny
    a.seq_len = a.seq_len or (32 if tiny else 8192)
    a.batch = a.batch or (2 if tiny else 1)
    a.steps = a.steps or (2 if tiny else 10)
    a.warmup = a.warmup or (1 if tiny else 3)
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(a.device)
    if device.type == "cuda":
        # An index, as the Trainer's devices have: init_process_group(device_id=...) refuses "cuda".
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    elif not a.tiny:
        print("error: no CUDA GPU here; an 8B-shaped model needs one (use --tiny for a CPU smoke run)", file=sys.stderr)
        return 2
    configs = [c.strip() for c in a.configs.split(",")]
    compiles = [{"off": False, "on": True}[c.strip()] for c in a.compile.split(",")]
    compile_configs = configs if a.compile_configs is None else [c.strip() for c in a.compile_configs.split(",")]
    unknown = [c for c in configs + compile_configs if c not in CONFIGS]
    if unknown:
        print(f"error: unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    start = time.perf_counter()
    init_process_group(device)
    # One mesh (every dim of size 1) for all configurations: each would otherwise create new groups.
    mesh = ParallelDims.from_config(load_config([]).parallelism, 1)
    mesh.build_mesh(device.type)
    # --layers auto sizes the model for what the planner decides for each configuration.
    specs = [memory_spec.from_plan(build_plan(c, False, a, device, mesh)[2]) for c in configs]
    layers, why = choose_layers(a, device, specs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    info = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seq_len": a.seq_len,
        "batch": a.batch,
        "ac": a.ac,
        "tf32": a.tf32,
        "layers_chosen": layers,
        "layers_reason": why,
        "command": shlex.join(["python", "-m", "benchmarks.gpu_mfu", *argv]),
    }
    print(
        f"gpu_mfu: {name}, torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"{'tiny shape' if a.tiny else 'Llama-3-8B shape'}, {layers} layers ({why}); seq {a.seq_len} x batch "
        f"{a.batch}, AC {a.ac}, TF32 {'on' if a.tf32 else 'off'}; MFU vs bf16 peak "
        f"{peak_flops(device, [torch.bfloat16]) / 1e12:.1f} TFLOP/s",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    write_json(a.json, {**info, "results": results})
    durations: dict[tuple[str, bool], float] = {}
    failed = False
    for compiled in compiles:
        for cfg in configs:
            if compiled and cfg not in compile_configs:
                continue
            elapsed = time.perf_counter() - start
            # Expected duration: the eager run of the same config, plus a compile allowance.
            expected = durations.get((cfg, False), 30.0) + (90.0 if compiled else 0.0)
            if not a.tiny and elapsed + expected > a.time_budget:
                results.append(
                    {
                        "config": cfg,
                        "compile": compiled,
                        "error": f"skipped: time budget "
                        f"({elapsed:.0f} s used, ~{expected:.0f} s needed, --time-budget {a.time_budget:.0f})",
                    }
                )
                print(f"  {cfg} compile={compiled}: skipped (time budget)", flush=True)
                continue
            t0 = time.perf_counter()
            r, layers = run_with_retries(cfg, compiled, layers, a, device, mesh)
            durations[cfg, compiled] = time.perf_counter() - t0
            results.append(r)
            failed |= "error" in r or not r["loss_finite"]
            print_result(r)
            write_json(a.json, {**info, "results": results})
    print()
    print(table(results))
    print(f"\n{info['command']}: {time.perf_counter() - start:.0f} s")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
