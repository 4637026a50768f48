#!/usr/bin/env python3
"""Where a Trainer step's time goes, by op: torch.profiler over a few steps of one or more
configurations of the same model in one process, their steps alternating, and one table of the
ops with the most self CPU time, a column per configuration.

    python -m benchmarks.profile_step --models large --batch 4 \\
        --configs "fp32=--mixed_precision.enabled false" "bf16=--mixed_precision.enabled true"

Each configuration is NAME=OVERRIDES (Trainer CLI overrides, split like a shell). The step times
printed first are from unprofiled steps (median), alternating as in benchmarks.overhead; the op
table comes from separately profiled steps (the profiler slows small ops, so its total is not the
step time). One process, all of this machine's cores for intra-op threads.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections import defaultdict

from benchmarks._common import CPU_MODELS, SHAPES, emit, header, load_average, md_table, num_params, use_model


def build(model: str, seq: int, batch: int, overrides: list[str], out: str):  # type: ignore[no-untyped-def]
    import torch

    from torchtitan_amp.config import load_config
    from torchtitan_amp.train.trainer import Trainer

    trainer = Trainer(
        load_config(
            [
                *use_model(model),
                "--training.seq_len",
                str(seq),
                "--training.local_batch_size",
                str(batch),
                "--training.steps",
                "1000",
                "--lr_scheduler.warmup_steps",
                "2",
                "--job.dump_folder",
                out,
                *overrides,
            ]
        )
    )
    with torch.random.fork_rng(devices=[]):
        batches = iter(trainer.run.dataloader)
    return lambda: trainer.train_step(batches)


def self_times(step, n: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Self CPU seconds per op name, per step, over n profiled steps."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    totals: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        totals[e.key] += e.self_cpu_time_total / 1e6 / n
    return totals


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="large", help=f"one of {', '.join(CPU_MODELS)}")
    p.add_argument("--configs", nargs="+", required=True, metavar="NAME=OVERRIDES")
    p.add_argument("--seq-len", type=int, default=0, help="0: the model's default")
    p.add_argument("--batch", type=int, default=0, help="0: the model's default")
    p.add_argument("--steps", type=int, default=3, help="timed (unprofiled) steps of each configuration")
    p.add_argument("--profiled", type=int, default=1, help="profiled steps of each configuration")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--top", type=int, default=25, help="ops in the table")
    p.add_argument("--out", default="outputs/bench_profile")
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    model = a.models
    seq, batch = a.seq_len or SHAPES[model][0], a.batch or SHAPES[model][1]
    configs = [c.split("=", 1) for c in a.configs]
    text = header("Where a step's time goes (CPU, one process)")
    steps = {name: build(model, seq, batch, shlex.split(args), f"{a.out}/{name}") for name, args in configs}
    for _ in range(a.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(a.steps):
        order = list(steps.items())
        for name, step in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    ops = {name: self_times(step, a.profiled) for name, step in steps.items()}
    first = configs[0][0]
    medians = {name: statistics.median(t) for name, t in times.items()}
    text += (
        f"load average at end: {load_average()}; model {model} ({num_params(model) / 1e6:.1f}M params), "
        f"seq {seq} x batch {batch}; median of {a.steps} alternating steps after {a.warmup} warm-up\n"
        f"command: python -m benchmarks.profile_step {shlex.join(argv)}\n\n"
    )
    text += (
        md_table(
            ["configuration", "overrides", "step ms (median)", f"vs {first}"],
            [
                [name, f"`{args}`", f"{medians[name] * 1e3:,.0f}", f"{medians[name] / medians[first]:.3f}"]
                for name, args in configs
            ],
        )
        + "\n\n"
    )
    # Ops ranked by the largest self time in any configuration: what bf16 removed shows too.
    names = sorted({k for o in ops.values() for k in o}, key=lambda k: -max(o.get(k, 0.0) for o in ops.values()))
    rows = [
        [f"`{k}`", *(f"{ops[c][k] * 1e3:,.1f}" if k in ops[c] else "-" for c, _ in configs)] for k in names[: a.top]
    ]
    rows.append(["(all ops, profiled)", *(f"{sum(ops[c].values()) * 1e3:,.1f}" for c, _ in configs)])
    text += md_table(["op (self CPU ms per step)", *(c for c, _ in configs)], rows) + "\n"
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
