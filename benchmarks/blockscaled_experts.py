#!/usr/bin/env python3
"""The loss gap to bf16 of a MoE model with block-scaled experts: debugmodel_moe trained single
process, one thread, in bf16, in emulated MXFP8 on the Linears alone and on the Linears plus the
routed experts (mixed_precision.block_scaled_experts), optionally NVFP4 (full recipe) with
experts, from the same seeds; per variant the mean |loss - bf16 loss| over the run and the gap at
the last step, for each seed.

    python -m benchmarks.blockscaled_experts                       # 30 steps, seeds 0,1,2: ~1 min
    python -m benchmarks.blockscaled_experts --steps 10 --seeds 0 --nvfp4

The model: blocks 1-2 of 4 converted (the edge blocks and `output` in bf16; block 0 is dense),
seq_len 32, batch 2, lr 3e-3 with 2 warm-up steps; tests/test_blockscaled_experts.py checks 10
steps of the mxfp8 variant.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._common import emit, header, md_table

BS = ["--mixed_precision.block_scaled_emulate", "true", "--mixed_precision.block_scaled"]
EXPERTS = ["--mixed_precision.block_scaled_experts", "true"]
VARIANTS = {"bf16": [], "mxfp8, Linears only": [*BS, "mxfp8"], "mxfp8, Linears + experts": [*BS, "mxfp8", *EXPERTS]}
NVFP4 = {"nvfp4 (2-D W, RHT, SR), Linears + experts": [*BS, "nvfp4", *EXPERTS]}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training.seed values")
    p.add_argument("--nvfp4", action="store_true", help="also the full NVFP4 recipe with experts")
    p.add_argument("--output", default=None, help="also write the report to this file")
    args = p.parse_args()

    import torch

    import torchtitan_amp.train.build as build
    from benchmarks.blockscaled_loss import _curve

    torch.set_num_threads(1)  # hundreds of small ops per step: a second thread only waits
    build.peak_flops = lambda device, dtype: 1e12  # MFU is not reported here: skip measuring it
    variants = {**VARIANTS, **(NVFP4 if args.nvfp4 else {})}
    seeds = [int(s) for s in args.seeds.split(",")]
    base = [
        "--model.name",
        "moe",
        "--model.flavor",
        "debugmodel_moe",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.gc_freq",
        "0",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--mixed_precision.enabled",
        "true",
        "--training.steps",
        str(args.steps),
    ]
    rows: dict[str, list[str]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            curves = {}
            for i, (name, extra) in enumerate(variants.items()):
                torch.manual_seed(0)
                curves[name] = _curve([*base, "--training.seed", str(seed)], extra, Path(tmp) / f"{seed}_{i}")
            for name, curve in curves.items():
                gaps = [a - b for a, b in zip(curve, curves["bf16"])]
                rows[name].append(f"{sum(map(abs, gaps)) / len(gaps):.4f} / {gaps[-1]:+.4f} ({curve[-1]:.4f})")
    text = (
        header(f"Block-scaled experts (emulated) vs bf16: debugmodel_moe, {args.steps} steps, seeds {args.seeds}")
        + "\n"
        + md_table(
            ["variant", *(f"seed {s}: mean abs gap / last gap (last loss)" for s in seeds)],
            [[name, *cells] for name, cells in rows.items()],
        )
    )
    emit(text, args.output)


if __name__ == "__main__":
    main()
