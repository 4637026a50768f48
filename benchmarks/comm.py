#!/usr/bin/env python3
"""Gradient and parameter traffic per step, counted on 2 CPU ranks: DDP fp32 vs DDP with the bf16
compress hook, FSDP fp32 vs the FSDP bf16 policy (with fp32 or bf16 gradient reduction).

    python -m benchmarks.comm                       # debug model, ~1-2 min
    python -m benchmarks.comm --models debug,large --output /tmp/comm.md

Counted, not estimated: every rank wraps torch.distributed's all_gather_single /
all_gather_into_tensor / reduce_scatter_single / reduce_scatter_tensor / all_reduce (what FSDP2
and the DDP comm hooks call) and adds up the bytes of one training step (the second; the first
is warm-up). For the compress hook the table also shows what the hook itself reports
(`precision.CompressHookState.bytes_sent`), which must agree. DDP without a hook all-reduces in
C++, out of Python's sight: there the worker registers torch's `allreduce_hook` (the same fp32
buckets through dist.all_reduce) so its bytes are seen.

Volumes are full tensor sizes (all-gather output, reduce-scatter input, all-reduce buffer), as in
torchtitan_amp.memory, whose analytic prediction is printed alongside; a ring moves (n-1)/n of
that per rank (twice for all-reduce). Step times are medians of a few steps on gloo over shared
memory: a CPU's gloo sums bf16 no faster than fp32, so fewer bytes need not mean faster here.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks._common import CPU_MODELS, SHAPES, emit, header, load_average, md_table, num_params, run_jobs, use_model
from torchtitan_amp.observability import traffic as collectives

DDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
FSDP = ["--parallelism.data_parallel_shard_degree", "2"]
FP32 = ["--mixed_precision.enabled", "false"]
BF16 = ["--mixed_precision.param_dtype", "bfloat16", "--mixed_precision.reduce_dtype", "float32"]
BF16_REDUCE = ["--mixed_precision.param_dtype", "bfloat16", "--mixed_precision.reduce_dtype", "bfloat16"]
CONFIGS = [
    ("DDP 2", "fp32", DDP + FP32),
    ("DDP 2", "bf16 autocast, fp32 reduce", DDP + BF16),
    ("DDP 2", "bf16 autocast, bf16 compress hook", DDP + BF16_REDUCE),
    ("FSDP 2", "fp32", FSDP + FP32),
    ("FSDP 2", "bf16 policy, fp32 reduce", FSDP + BF16),
    ("FSDP 2", "bf16 policy, bf16 reduce", FSDP + BF16_REDUCE),
]

# ---------------------------------------------------------------------------------------------
# Worker side: count collectives

HOOK_STATES: list = []


def install_counters() -> None:
    """Count the collectives (torchtitan_amp/observability/traffic.py, by op), make DDP's default all-reduce
    visible, and keep every compress-hook state installed so that its own byte count can be read."""
    from torchtitan_amp.train import data_parallel

    collectives.install()
    collectives.install_default_ddp_hook()
    original_install = data_parallel.install_comm_hook

    def install_comm_hook(model, state):  # type: ignore[no-untyped-def]
        HOOK_STATES.append(state)
        original_install(model, state)

    data_parallel.install_comm_hook = install_comm_hook


def worker(spec_path: str, out_path: str) -> int:
    import logging

    import torch
    import torch.distributed as dist

    from torchtitan_amp import memory
    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.train.dry_run import resolve
    from torchtitan_amp.train.trainer import Trainer

    logging.basicConfig(level=logging.WARNING)
    install_counters()
    results = []
    for job in json.loads(Path(spec_path).read_text()):
        config = load_config([*use_model(job["model"]), *job["args"]])
        HOOK_STATES.clear()
        trainer = Trainer(config)
        with torch.random.fork_rng(devices=[]):
            batches = iter(trainer.run.dataloader)
        trainer.train_step(batches)  # warm-up: lazy init
        hook_before = {k: v for s in HOOK_STATES if s for k, v in s.bytes_sent.items()}
        with collectives.counting():
            trainer.train_step(batches)
        counted = collectives.snapshot()
        hook = {k: v - hook_before.get(k, 0) for s in HOOK_STATES if s for k, v in s.bytes_sent.items()}
        times = []
        for _ in range(job["timed_steps"]):
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step(batches)
            times.append(time.perf_counter() - start)
        res = resolve(config, trainer.run.info.world_size)
        predicted = memory.comm(res.model_dims, res.precision, res.layout)
        results.append(
            {
                **job,
                "counted": counted,
                "hook_bytes_sent": hook,
                "predicted": predicted,
                "path": trainer.run.plan.path,
                "comm_hook": trainer.run.plan.comm_hook,
                "step_s": statistics.median(times) if times else None,
            }
        )
        trainer.run.metrics.close()
        del trainer, batches
        gc.collect()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    process_groups.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------
# Driver


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def by_dtype(d: dict[str, int]) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    return " + ".join(f"{mib(v)} {short.get(k, k)}" for k, v in sorted(d.items())) or "-"


def report(results: list[dict]) -> str:
    rows = []
    base: dict[tuple[str, str], int] = {}
    # Gradient-norm scalars are all-reduced too (a few bytes): keep them out of the gradient column.
    small = 1024
    for r in results:
        c = r["counted"]
        grads = (
            {k: v for k, v in c.get("all_reduce", {}).items() if v > small}
            if r["layout"].startswith("DDP")
            else c.get("reduce_scatter", {})
        )
        gathers = c.get("all_gather", {})
        total = sum(grads.values()) + sum(gathers.values())
        if r["precision"] == "fp32":
            base[r["model"], r["layout"]] = total
        pred = r["predicted"]
        pred_grads = pred.get("ddp_all_reduce") or pred.get("fsdp_reduce_scatter") or {}
        pred_gather = pred.get("fsdp_all_gather", {})
        agree = "yes" if (pred_grads == grads and pred_gather == gathers) else "NO"
        hook = by_dtype(r["hook_bytes_sent"]) if r["hook_bytes_sent"] else "-"
        rows.append(
            [
                r["model"],
                r["layout"],
                r["precision"],
                by_dtype(grads),
                by_dtype(gathers) if gathers else "-",
                mib(total),
                f"{total / base[r['model'], r['layout']]:.2f}",
                hook,
                agree,
                f"{r['step_s'] * 1e3:,.0f}" if r["step_s"] else "-",
            ]
        )
    return md_table(
        [
            "model",
            "layout",
            "precision",
            "gradient traffic MiB (DDP all-reduce / FSDP reduce-scatter)",
            "FSDP all-gather MiB",
            "total MiB",
            "vs fp32",
            "compress hook bytes_sent MiB",
            "= torchtitan_amp.memory prediction",
            "step ms",
        ],
        rows,
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--models", default="debug", help=f"comma-separated, from {', '.join(CPU_MODELS)}")
    p.add_argument("--timed-steps", type=int, default=3, help="steps timed after the counted one")
    p.add_argument("--out", default="outputs/bench_comm")
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    out = Path(a.out).resolve()
    jobs = []
    for model in a.models.split(","):
        seq, batch = SHAPES[model]
        for layout, precision, args in CONFIGS:
            jobs.append(
                {
                    "model": model,
                    "layout": layout,
                    "precision": precision,
                    "timed_steps": a.timed_steps,
                    "args": [
                        "--training.seq_len",
                        str(seq),
                        "--training.local_batch_size",
                        str(batch // 2),
                        "--training.steps",
                        "1000",
                        "--job.dump_folder",
                        str(out / f"{model}_{layout}_{precision}".replace(" ", "").replace(",", "_")),
                        *args,
                    ],
                }
            )
    start = time.perf_counter()
    results = run_jobs(__spec__.name, 2, jobs, out, "comm")
    sizes = "; ".join(
        f"{m}: {num_params(m) / 1e6:.1f}M parameters ({num_params(m) * 4 / 2**20:,.1f} MiB in fp32), "
        f"seq {SHAPES[m][0]} x global batch {SHAPES[m][1]}"
        for m in a.models.split(",")
    )
    text = (
        header("Communication per step (2 CPU ranks, gloo)")
        + f"load average at end: {load_average()}; took {(time.perf_counter() - start) / 60:.1f} min; {sizes}\n"
        + f"command: python -m benchmarks.comm {shlex.join(argv)}\n\n"
        + report(results)
        + "\n"
    )
    emit(text, a.output)
    bad = [
        r
        for r in results
        if r["hook_bytes_sent"]
        and r["hook_bytes_sent"] != {k: v for k, v in r["counted"].get("all_reduce", {}).items() if v > 1024}
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
