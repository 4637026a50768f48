#!/usr/bin/env python3
"""Context parallel on CPU: activation memory per rank vs the cp degree, measured against the
memory model, and the step time of CP 2 against one process and FSDP 2 at equal tokens.

    python -m benchmarks.context_parallel                       # debugmodel_tiny, seq 8192, ~5-10 min
    python -m benchmarks.context_parallel --seq-len 16384 --mask-types block_causal

Memory: for each mask type and cp in --cps, one window of --seq-len tokens per step, trained 2
steps in a fresh torchrun launch of cp ranks (torchtitan_amp/tools/estimate_memory.py --measure:
growth of resident memory from just before the model is built to its peak). cp 1 is a single
process. The estimate is torchtitan_amp.memory's for the same config as this CPU saves it
(device "cpu"), with the GPU estimate beside it; at these lengths the activations are most of
it. block_causal: most of those are SDPA's additive copy of the explicit mask, saved in every
layer, S / cp x S x 4 bytes (fp32). Causal under CP: no mask on a GPU; on CPU, SDPA builds each
query chunk's lower-right causal mask, (2cp + 1) x (S / 2cp)^2 x 4 bytes per layer, shared by
the batch (the difference between the two estimate columns).

Time: 2 windows per step in every layout (equal tokens): one process with both, FSDP 2 with one
window per rank, CP 2 with both windows split over the two ranks. torchrun gives each rank one
thread, so FSDP 2 and CP 2 have twice the cores of the single process; the CP / FSDP ratio is the
price of context parallel itself (K/V all-gathers and their reorder, two attention calls per
layer instead of one, and on CPU a materialised mask per chunk).
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

from benchmarks._common import emit, header, load_average, md_table, run_jobs
from torchtitan_amp.tools import estimate_memory

FLAVOR = "debugmodel_tiny"
FP32 = ["--mixed_precision.enabled", "false"]
TIMED = {  # name: (processes, overrides); local batch is the per-data-parallel-rank count
    "single": (1, ["--training.local_batch_size", "2"]),
    "FSDP 2": (2, ["--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2"]),
    "CP 2": (2, ["--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2"]),
}


def worker(spec_path: str, out_path: str) -> int:
    import logging

    import torch
    import torch.distributed as dist

    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.train.trainer import Trainer

    logging.basicConfig(level=logging.WARNING)
    results = []
    for job in json.loads(Path(spec_path).read_text()):
        trainer = Trainer(load_config(job["args"]))
        with torch.random.fork_rng(devices=[]):
            batches = iter(trainer.run.dataloader)
        trainer.train_step(batches)  # warm-up: lazy init
        times = []
        for _ in range(job["timed_steps"]):
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            trainer.train_step(batches)
            times.append(time.perf_counter() - start)
        results.append({**job, "step_s": statistics.median(times)})
        trainer.run.metrics.close()
        del trainer, batches
        gc.collect()
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    process_groups.shutdown()
    return 0


def memory_rows(a: argparse.Namespace, out: Path) -> list[list[str]]:
    from torchtitan_amp import memory
    from torchtitan_amp.config import load_config

    fb = memory.fmt_bytes
    rows = []
    for mask in a.mask_types.split(","):
        for cp in (int(c) for c in a.cps.split(",")):
            overrides = [
                "--model.flavor",
                FLAVOR,
                "--training.seq_len",
                str(a.seq_len),
                "--training.local_batch_size",
                "1",
                "--model.attn_mask_type",
                mask,
                "--parallelism.context_parallel_degree",
                str(cp),
                *FP32,
            ]
            config = load_config(overrides)
            est, gpu = estimate_memory.estimate(config, cp, "cpu"), estimate_memory.estimate(config, cp)
            measured = estimate_memory.measure(overrides, cp, 2, out / f"mem_{mask}_cp{cp}")
            peak = max(m["rss_peak_delta"] for m in measured)
            predicted = est["peak"]["configured"]
            rows.append(
                [
                    mask,
                    cp,
                    f"{a.seq_len // cp:,}",
                    fb(gpu["activations"]["configured"]),
                    fb(est["activations"]["configured"]),
                    fb(predicted),
                    fb(peak),
                    f"{peak / predicted:.2f}",
                ]
            )
            print(f"memory {mask} cp {cp}: peak RSS +{fb(peak)} (estimate {fb(predicted)})", flush=True)
    return rows


def time_rows(a: argparse.Namespace, out: Path) -> list[list[str]]:
    results = {}
    for nproc in (1, 2):
        jobs = [
            {
                "name": name,
                "timed_steps": a.timed_steps,
                "args": [
                    "--model.flavor",
                    FLAVOR,
                    "--training.seq_len",
                    str(a.time_seq_len),
                    "--training.steps",
                    "1000",
                    "--job.dump_folder",
                    str(out / name.replace(" ", "")),
                    *FP32,
                    *args,
                ],
            }
            for name, (n, args) in TIMED.items()
            if n == nproc
        ]
        for r in run_jobs(__spec__.name, nproc, jobs, out, f"time{nproc}"):
            results[r["name"]] = r["step_s"]
    base = results["single"]
    return [
        [
            name,
            TIMED[name][0],
            f"{results[name]:.3f}",
            f"{results[name] / base:.2f}",
            f"{results[name] / results['FSDP 2']:.2f}",
        ]
        for name in TIMED
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=8192, help="window of the memory runs (default %(default)s)")
    p.add_argument("--cps", default="1,2,4", help="cp degrees of the memory runs (default %(default)s)")
    p.add_argument(
        "--mask-types", default="causal,block_causal", help="model.attn_mask_type values (default %(default)s)"
    )
    p.add_argument("--time-seq-len", type=int, default=4096, help="window of the timed runs (default %(default)s)")
    p.add_argument("--timed-steps", type=int, default=3)
    p.add_argument("--skip", choices=("memory", "time"), help="run only the other half")
    p.add_argument("--out", default="outputs/bench_context_parallel")
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    out = Path(a.out).resolve()
    start = time.perf_counter()
    text = header("Context parallel (CPU, gloo, fp32)")
    body = ""
    if a.skip != "memory":
        body += (
            f"\n### Peak memory per rank, one window of {a.seq_len:,} tokens ({FLAVOR}, 2 steps)\n\n"
            + md_table(
                [
                    "mask",
                    "cp",
                    "tokens per rank",
                    "activations (GPU estimate)",
                    "activations (CPU estimate)",
                    "peak (CPU estimate)",
                    "peak RSS growth (measured)",
                    "measured / estimate",
                ],
                memory_rows(a, out),
            )
            + "\n"
        )
    if a.skip != "time":
        body += (
            f"\n### Step time, 2 windows of {a.time_seq_len:,} tokens per step ({FLAVOR}, median of "
            f"{a.timed_steps})\n\n"
            + md_table(["layout", "processes", "step s", "/ single", "/ FSDP 2"], time_rows(a, out))
            + "\n"
        )
    text += (
        f"load average at end: {load_average()}; took {(time.perf_counter() - start) / 60:.1f} min\n"
        f"command: python -m benchmarks.context_parallel {shlex.join(argv)}\n" + body
    )
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
