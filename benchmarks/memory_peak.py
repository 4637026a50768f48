#!/usr/bin/env python3
"""Peak memory per rank, DDP vs FSDP, at 1, 2 and 4 CPU ranks, measured, with the analytic
estimate of torchtitan_amp.memory alongside.

    python -m benchmarks.memory_peak                        # medium model (27.5M params), ~3-5 min
    python -m benchmarks.memory_peak --model debug --precision bf16

Each layout trains 2 steps in a fresh torchrun launch (torchtitan_amp/tools/estimate_memory.py --measure):
per rank, the growth of resident memory (RSS) from just before the model is built to its peak
during build + 2 steps (VmHWM reset at that point; glibc told to unmap freed tensors), and the
exact bytes of parameters + gradients + AdamW state summed over the real tensors. The local batch
is the same on every rank count (weak scaling: activations per rank stay constant), so the
difference between the columns is what sharding saves. 1 rank is plain single-process training
(neither DDP nor FSDP).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from benchmarks._common import CPU_MODELS, emit, header, load_average, md_table, num_params
from torchtitan_amp.tools import estimate_memory

LAYOUTS = {
    "single": (1, []),
    "DDP 2": (
        2,
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    ),
    "FSDP 2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "DDP 4": (
        4,
        ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"],
    ),
    "FSDP 4": (4, ["--parallelism.data_parallel_shard_degree", "4"]),
}
PRECISIONS = {"fp32": ["--mixed_precision.enabled", "false"], "bf16": ["--mixed_precision.param_dtype", "bfloat16"]}


def shape_of(model: str) -> str | None:
    spec = CPU_MODELS[model]
    return ",".join(f"{k}={v}" for k, v in spec.get("replace", {}).items()) or None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="medium", choices=list(CPU_MODELS))
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", default="outputs/bench_memory")
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    from torchtitan_amp import memory
    from torchtitan_amp.config import load_config

    fb = memory.fmt_bytes
    flavor = CPU_MODELS[a.model]["flavor"]
    shape = shape_of(a.model)
    text = header("Peak memory per rank (CPU, RSS)")
    start = time.perf_counter()
    rows = []
    for name in a.layouts.split(","):
        nproc, layout_args = LAYOUTS[name]
        overrides = [
            "--model.flavor",
            flavor,
            "--training.seq_len",
            str(a.seq_len),
            "--training.local_batch_size",
            str(a.local_batch),
            *layout_args,
            *PRECISIONS[a.precision],
        ]
        config = load_config(overrides)
        estimate_memory.apply_shape(flavor, shape)
        est = estimate_memory.estimate(config, nproc)
        measured = estimate_memory.measure(overrides, nproc, 2, Path(a.out).resolve() / name.replace(" ", ""), shape)
        peak = max(m["rss_peak_delta"] for m in measured)
        state = max(sum(memory.sum_bytes(m[k]) for k in ("params", "grads", "optimizer")) for m in measured)
        st = est["state"]
        state_est = sum(memory.sum_bytes(st[k]) for k in ("params", "grads", "optimizer"))
        rows.append(
            [
                name,
                nproc,
                fb(state),
                fb(state_est),
                fb(memory.sum_bytes(est["transient"])),
                fb(est["activations"]["configured"]),
                fb(peak),
                fb(est["peak"]["configured"]),
                f"{peak / est['peak']['configured']:.2f}",
            ]
        )
        print(f"{name}: peak RSS +{fb(peak)} (estimate {fb(est['peak']['configured'])})", flush=True)
    text += (
        f"load average at end: {load_average()}; took {(time.perf_counter() - start) / 60:.1f} min\n"
        f"model {a.model} ({num_params(a.model) / 1e6:.1f}M parameters), {a.precision}, seq {a.seq_len} x local "
        f"batch {a.local_batch} per rank, 2 steps; the largest rank of each layout\n"
        f"command: python -m benchmarks.memory_peak {shlex.join(argv)}\n\n"
    )
    text += (
        md_table(
            [
                "layout",
                "ranks",
                "params+grads+AdamW (tensors)",
                "(estimate)",
                "transient (estimate)",
                "activations (estimate)",
                "peak RSS growth (measured)",
                "peak (estimate)",
                "measured / estimate",
            ],
            rows,
        )
        + "\n"
    )
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
