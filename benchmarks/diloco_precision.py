#!/usr/bin/env python3
"""DiLoCo with fp32 against bf16 pseudo-gradients: the loss gap the wire dtype costs.

Three trainings of two torchft replica groups each (one-rank groups, gloo, a lighthouse in this
process), the same seed, data and steps, one after another:

- `every step`: semi_sync_method = none, gradients averaged across the groups every step (context);
- `diloco fp32`: semi_sync_method = diloco, pseudo-gradients all-reduced in float32;
- `diloco bf16`: the same with fault_tolerance.pseudo_gradient_dtype = bfloat16.

On one CPU thread per rank every run is deterministic, so the fp32/bf16 gap is the bf16 wire's
alone (each group's pseudo-gradient rounded once to bf16, then torchft's sum and mean in bf16).
Prints the groups' mean loss every sync, the gap, and the mean over the last sync interval.

    python -m benchmarks.diloco_precision [--steps 60] [--sync-steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._common import header, md_table
from torchtitan_amp.tools.common import torchrun

# debugmodel_tiny as the tests train it (tests/support/inputs.py TINY): a fast, well-conditioned run.
MODEL = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
]
VARIANTS = {
    "every step": [],
    "diloco fp32": ["--fault_tolerance.semi_sync_method", "diloco"],
    "diloco bf16": [
        "--fault_tolerance.semi_sync_method",
        "diloco",
        "--fault_tolerance.pseudo_gradient_dtype",
        "bfloat16",
    ],
}


def train_groups(name: str, extra: list[str], steps: int, sync_steps: int, root: Path) -> dict[int, float]:
    """Both groups of one variant, concurrently against a fresh lighthouse; step -> the groups'
    mean loss."""
    from torchft._torchft import LighthouseServer

    # min_replicas 2: the first quorum waits for both groups, so neither trains a step alone.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60000)
    sync = ["--fault_tolerance.sync_steps", str(sync_steps)] if extra else []
    folders = [root / name.replace(" ", "_") / f"group{g}" for g in (0, 1)]
    folders[0].parent.mkdir(parents=True, exist_ok=True)
    try:
        with ThreadPoolExecutor(2) as pool:
            codes = list(
                pool.map(
                    lambda g: torchrun(
                        "torchtitan_amp",
                        1,
                        [
                            *MODEL,
                            "--training.steps",
                            str(steps),
                            "--fault_tolerance.enable",
                            "true",
                            "--fault_tolerance.group_size",
                            "2",
                            "--fault_tolerance.replica_id",
                            str(g),
                            *extra,
                            *sync,
                            "--job.dump_folder",
                            str(folders[g]),
                        ],
                        folders[g].parent / f"group{g}.log",
                        timeout=1800,
                        env={"TORCHFT_LIGHTHOUSE": lighthouse.address(), "OMP_NUM_THREADS": "1"},
                    ),
                    (0, 1),
                )
            )
    finally:
        lighthouse.shutdown()
    for g, code in enumerate(codes):
        if code != 0:
            raise SystemExit(f"{name}: group {g} failed ({code}); see {folders[g].parent / f'group{g}.log'}")
    losses: dict[int, list[float]] = {}
    for folder in folders:
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "loss" in row and "step" in row:
                losses.setdefault(row["step"], []).append(row["loss"])
    return {s: statistics.mean(v) for s, v in sorted(losses.items())}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sync-steps", type=int, default=5)
    a = p.parse_args(argv)
    if a.steps < a.sync_steps or a.sync_steps < 1:
        p.error("need --steps >= --sync-steps >= 1")
    with tempfile.TemporaryDirectory(prefix="diloco_precision_") as tmp:
        curves = {name: train_groups(name, extra, a.steps, a.sync_steps, Path(tmp)) for name, extra in VARIANTS.items()}
    fp32, bf16, every = curves["diloco fp32"], curves["diloco bf16"], curves["every step"]
    rows = [
        [s, f"{every[s]:.4f}", f"{fp32[s]:.4f}", f"{bf16[s]:.4f}", f"{bf16[s] - fp32[s]:+.2e}"]
        for s in fp32
        if s % a.sync_steps == 0 or s == 1
    ]
    print(
        header(
            f"DiLoCo pseudo-gradients fp32 vs bf16 (debugmodel_tiny, 2 one-rank groups, {a.steps} steps, "
            f"sync every {a.sync_steps}; loss = the groups' mean)"
        )
    )
    print(md_table(["step", "every step", "diloco fp32", "diloco bf16", "bf16 - fp32"], rows))
    last = [s for s in fp32 if s > a.steps - a.sync_steps]
    gap = statistics.mean(bf16[s] - fp32[s] for s in last)
    worst = max(abs(bf16[s] - fp32[s]) for s in fp32)
    mean_fp32 = statistics.mean(fp32[s] for s in last)
    print(
        f"\nlast {len(last)} steps: diloco fp32 {mean_fp32:.4f}, bf16 {statistics.mean(bf16[s] for s in last):.4f}, "
        f"every step {statistics.mean(every[s] for s in last):.4f}; bf16 - fp32 = {gap:+.2e} "
        f"({gap / mean_fp32:+.2%}); largest |bf16 - fp32| at any step {worst:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
