#!/usr/bin/env python3
"""Precision speed on CPU: step time, tokens/s and MFU of fp32 vs bf16 autocast vs the FSDP bf16
policy, single process and 2 ranks, for the debug model and a 103M model (dim 1024, 8 layers).

    python -m benchmarks.precision_speed                    # debug + large, ~5-10 min on 2 cores
    python -m benchmarks.precision_speed --models debug_h64 --steps 5 --output /tmp/speed.md

Every configuration trains through torchtitan_amp's Trainer (train_step), one torchrun launch per
process count. fp32 and bf16 Trainers of the same model and layout are built side by side in one
process and their timed steps alternate, so that load from other processes on a shared machine
hits both alike: the speed-up column is the robust number, absolute times are not. The global
batch is the same in every layout (2 ranks run half the local batch), so the tokens per step are
equal and step times compare directly. MFU = achieved FLOP/s per process /
the best of the fp32 and bf16 matmul rates this CPU reached with the same thread count, measured at
start-up the way torchtitan_amp.observability.metrics does (where bf16 is native, the bf16 peak: fp32 runs show
what they leave on the table, like torchtitan's GPU MFU). FSDP needs at least 2 data-parallel ranks
in torchtitan_amp, so the FSDP policy appears in the 2-rank rows only.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path

from benchmarks._common import (
    CPU_MODELS,
    SHAPES,
    emit,
    header,
    load_average,
    md_table,
    num_params,
    run_jobs,
    summarize,
    use_model,
)

FP32 = ["--mixed_precision.enabled", "false"]
BF16 = ["--mixed_precision.enabled", "true", "--mixed_precision.param_dtype", "bfloat16"]
LAYOUTS = {
    1: [("single", [])],
    2: [
        (
            "DDP 2",
            ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
        ),
        ("FSDP 2", ["--parallelism.data_parallel_shard_degree", "2"]),
    ],
}


def worker(spec_path: str, out_path: str) -> int:
    import logging

    import torch
    import torch.distributed as dist

    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.observability.metrics import peak_flops
    from torchtitan_amp.train.trainer import Trainer

    logging.basicConfig(level=logging.WARNING)
    jobs = json.loads(Path(spec_path).read_text())
    cpu = torch.device("cpu")
    peaks = {
        name: peak_flops(cpu, [dtype]) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    results = []
    for job in jobs:
        # Both precisions of a (model, layout) live in this process and their steps alternate
        # (fp32, bf16, fp32, ...), so load changes on a shared machine hit both alike.
        overrides = use_model(job["model"])
        trainers, iters = [], []
        for prec in job["precisions"]:
            trainer = Trainer(load_config([*overrides, *job["args"], *prec["args"]]))
            with torch.random.fork_rng(devices=[]):
                iters.append(iter(trainer.run.dataloader))
            trainers.append(trainer)
        for _ in range(job["warmup"]):
            for trainer, batches in zip(trainers, iters):
                trainer.train_step(batches)
        times: list[list[float]] = [[] for _ in trainers]
        for _ in range(job["steps"]):
            for i, (trainer, batches) in enumerate(zip(trainers, iters)):
                if dist.is_initialized():
                    dist.barrier()
                start = time.perf_counter()
                trainer.train_step(batches)
                times[i].append(time.perf_counter() - start)
        for prec, trainer, t in zip(job["precisions"], trainers, times):
            results.append(
                {
                    **{k: v for k, v in job.items() if k not in ("precisions", "args")},
                    "precision": prec["name"],
                    "times": t,
                    "path": trainer.run.plan.path,
                    "flops_per_token": trainer.flops_per_token,
                    "threads": torch.get_num_threads(),
                    "world_size": trainer.run.info.world_size,
                    "peaks": peaks,
                }
            )
            trainer.run.metrics.close()
        del trainers, iters, trainer, batches
        gc.collect()
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    process_groups.shutdown()
    return 0


def jobs_for(nproc: int, models: list[str], steps: int, warmup: int, out: Path) -> list[dict]:
    jobs = []
    for model in models:
        seq, batch = SHAPES[model]
        big = model == "large"
        for layout, layout_args in LAYOUTS[nproc]:
            folder = out / f"{model}_{layout}".replace(" ", "")
            jobs.append(
                {
                    "model": model,
                    "layout": layout,
                    "nproc": nproc,
                    "tokens_per_step": seq * batch,
                    "warmup": 1 if big else warmup,
                    "steps": steps,
                    "args": [
                        "--training.seq_len",
                        str(seq),
                        "--training.local_batch_size",
                        str(batch // nproc),
                        "--training.steps",
                        "1000",
                        "--lr_scheduler.warmup_steps",
                        "2",
                        *layout_args,
                    ],
                    "precisions": [
                        {"name": name, "args": [*args, "--job.dump_folder", str(folder / name)]}
                        for name, args in (("fp32", FP32), ("bf16", BF16))
                    ],
                }
            )
    return jobs


def report(results: list[dict]) -> str:
    rows = []
    base: dict[tuple[str, str], tuple[float, float]] = {}
    for r in results:
        if r["precision"] == "fp32":
            base[r["model"], r["layout"]] = (summarize(r["times"]), min(r["times"]))
    for r in results:
        step = summarize(r["times"])
        tps = r["tokens_per_step"] / step
        flops_per_proc = tps * r["flops_per_token"] / r["world_size"]
        # The trainer's denominator: the best of the dtypes a step computes in (bf16 alone would put
        # MFU above 100% where bf16 is emulated and the fp32 run is the fast one).
        mfu = 100 * flops_per_proc / max(r["peaks"].values())
        speedup = base[r["model"], r["layout"]][0] / step
        speedup_best = base[r["model"], r["layout"]][1] / min(r["times"])
        prec = (
            {"full": "fp32", "autocast": "bf16 autocast", "fsdp": "bf16 FSDP policy"}[r["path"]]
            if r["precision"] == "bf16"
            else "fp32"
        )
        rows.append(
            [
                r["model"],
                r["layout"],
                prec,
                f"{step * 1e3:,.0f}",
                f"{tps:,.0f}",
                f"{flops_per_proc / 1e9:.1f}",
                f"{mfu:.1f}%",
                f"{speedup:.2f}x / {speedup_best:.2f}x",
            ]
        )
    peaks = {(r["world_size"], r["threads"]): r["peaks"] for r in results}
    notes = [
        f"- peak matmul FLOP/s per process ({ws} process(es) x {th} thread(s)): fp32 "
        f"{p['float32'] / 1e9:.0f} GFLOP/s, bf16 {p['bfloat16'] / 1e9:.0f} GFLOP/s "
        f"(bf16/fp32 {p['bfloat16'] / p['float32']:.1f}x)"
        for (ws, th), p in sorted(peaks.items())
    ]
    sizes = sorted({r["model"] for r in results}, key=list(CPU_MODELS).index)
    notes += [
        f"- {m}: {num_params(m) / 1e6:.1f}M parameters, seq_len {SHAPES[m][0]}, global batch "
        f"{SHAPES[m][1]} sequences, median of {next(r['steps'] for r in results if r['model'] == m)} timed steps"
        for m in sizes
    ]
    table = md_table(
        [
            "model",
            "layout",
            "precision",
            "step ms",
            "tokens/s",
            "GFLOP/s per process",
            "MFU (best fp32/bf16 peak)",
            "speed-up vs fp32 (median / best step)",
        ],
        rows,
    )
    return table + "\n\n" + "\n".join(notes)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--models", default="debug,large", help=f"comma-separated, from {', '.join(CPU_MODELS)}")
    p.add_argument("--nprocs", default="1,2", help="process counts (default %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (1 for the large model)")
    p.add_argument("--out", default="outputs/bench_precision_speed")
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    models = a.models.split(",")
    out = Path(a.out).resolve()
    text = header("Precision speed (CPU)")
    start = time.perf_counter()
    results = []
    for nproc in (int(n) for n in a.nprocs.split(",")):
        results += run_jobs(__spec__.name, nproc, jobs_for(nproc, models, a.steps, a.warmup, out), out, f"{nproc}proc")
    text += (
        f"load average at end: {load_average()}; took {(time.perf_counter() - start) / 60:.1f} min\n"
        f"command: python -m benchmarks.precision_speed {shlex.join(argv)}\n\n" + report(results) + "\n"
    )
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
