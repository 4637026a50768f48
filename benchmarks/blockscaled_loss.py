#!/usr/bin/env python3
"""The loss gap of block-scaled training to bf16: the tiny model trained single process, one
thread, in bf16 and in the emulated MXFP8, NVFP4 (NVIDIA's full recipe: 2-D weights, RHT, SR) and
NVFP4 with RHT, SR or all three options off, from the same seeds; per variant the mean |loss -
bf16 loss| over the run and the gap at the last step, for each seed.

    python -m benchmarks.blockscaled_loss                          # 30 steps, seeds 0,1,2: ~30 s
    python -m benchmarks.blockscaled_loss --steps 100 --seeds 0 --flavor debugmodel

The model: the flavor (default debugmodel_tiny) with its first and last block and `output` in
bf16 (mixed_precision.block_scaled_edge_layers = 1, the default), seq_len 32, batch 2, lr 3e-3
with 2 warm-up steps; tests/test_blockscaled_train.py checks 10 steps of it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._common import emit, header, md_table

BS = ["--mixed_precision.block_scaled_emulate", "true", "--mixed_precision.block_scaled"]
NV = [*BS, "nvfp4"]
VARIANTS = {
    "bf16": [],
    "mxfp8": [*BS, "mxfp8"],
    "nvfp4 (2-D W, RHT, SR)": NV,
    "nvfp4, RHT off": [*NV, "--mixed_precision.nvfp4_rht", "false"],
    "nvfp4, SR off": [*NV, "--mixed_precision.nvfp4_stochastic_rounding", "false"],
    "nvfp4, 1x16 W, RHT and SR off": [
        *NV,
        "--mixed_precision.nvfp4_rht",
        "false",
        "--mixed_precision.nvfp4_stochastic_rounding",
        "false",
        "--mixed_precision.nvfp4_weight_2d",
        "false",
    ],
}


def _curve(base: list[str], extra: list[str], folder: Path) -> list[float]:
    from tests.support.launch import by_step
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import trainer as trainer_module

    trainer_module.Trainer(load_config([*base, *extra, "--job.dump_folder", str(folder)])).train()
    losses = by_step(folder)
    return [losses[s]["loss"] for s in sorted(losses)]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training.seed values")
    p.add_argument("--flavor", default="debugmodel_tiny")
    p.add_argument("--output", default=None, help="also write the report to this file")
    args = p.parse_args()

    import torch

    import torchtitan_amp.train.build as build

    torch.set_num_threads(1)  # hundreds of small ops per step: a second thread only waits
    build.peak_flops = lambda device, dtype: 1e12  # MFU is not reported here: skip measuring it
    seeds = [int(s) for s in args.seeds.split(",")]
    base = [
        "--model.flavor",
        args.flavor,
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
    rows: dict[str, list[str]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            curves = {
                name: _curve([*base, "--training.seed", str(seed)], extra, Path(tmp) / f"{seed}_{i}")
                for i, (name, extra) in enumerate(VARIANTS.items())
            }
            for name, curve in curves.items():
                gaps = [a - b for a, b in zip(curve, curves["bf16"])]
                rows[name].append(f"{sum(map(abs, gaps)) / len(gaps):.4f} / {gaps[-1]:+.4f} ({curve[-1]:.4f})")
    text = (
        header(f"Block-scaled (emulated) vs bf16: {args.flavor}, {args.steps} steps, seeds {args.seeds}")
        + "\n"
        + md_table(
            ["variant", *(f"seed {s}: mean abs gap / last gap (last loss)" for s in seeds)],
            [[name, *cells] for name, cells in rows.items()],
        )
    )
    emit(text, args.output)


if __name__ == "__main__":
    main()
