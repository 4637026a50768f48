#!/usr/bin/env python3
"""Loss curves of the weight and optimizer-state precision choices against fp32, one process:

- fp32 (the reference), mixed bf16 (fp32 master weights, bf16 autocast),
- mixed bf16 with bf16 AdamW moments (`optimizer.state_dtype = "bfloat16"`),
- pure bf16 (`training.dtype = "bfloat16"`: bf16 weights, gradients and moments, round to nearest),
- pure bf16 with stochastic rounding of the weight update (`optimizer.stochastic_rounding`),
- pure bf16 with fp32 moments and stochastic rounding.

Same model, data, seed and schedule for all; it prints the loss at a few steps, the mean of the
last 50 steps' losses, and the largest and mean deviation from the fp32 curve, plus the bytes per
trained parameter each choice holds (parameter + gradient + AdamW moments, as the precision report
gives them). The numbers are this run's; on CPU the bf16 matmuls of mixed precision are the
machine's (native or emulated), the curves do not depend on speed.

    python -m benchmarks.optimizer_precision [--steps 300] [--model debug_h64] [--output FILE] [--json FILE]

`--json FILE` also writes every choice's per-step losses, the data of docs/numerics.md's figure
(`python -m torchtitan_amp.tools.numerics_figures docs/img` draws it without retraining).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks._common import emit, header, md_table, use_model
from torchtitan_amp.tools.common import machine

PURE = ["--training.dtype", "bfloat16", "--mixed_precision.enabled", "false"]
CHOICES: dict[str, list[str]] = {
    "fp32": ["--mixed_precision.enabled", "false"],
    "mixed bf16": ["--mixed_precision.enabled", "true"],
    "mixed bf16, bf16 moments": ["--mixed_precision.enabled", "true", "--optimizer.state_dtype", "bfloat16"],
    "pure bf16": PURE,
    "pure bf16 + stochastic rounding": [*PURE, "--optimizer.stochastic_rounding"],
    "pure bf16, fp32 moments + SR": [*PURE, "--optimizer.state_dtype", "float32", "--optimizer.stochastic_rounding"],
}


def curve(name: str, args: list[str], out: Path) -> tuple[list[float], dict, float]:
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import trainer as trainer_module

    trainer_module.peak_flops = lambda device, dtypes: 1e12  # MFU is not read here
    folder = out / name.replace(" ", "_").replace(",", "").replace("+", "plus")
    shutil.rmtree(folder, ignore_errors=True)  # metrics.jsonl appends: an earlier run would mix in
    start = time.perf_counter()
    trainer = trainer_module.Trainer(load_config([*args, "--job.dump_folder", str(folder)]))
    trainer.train()
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and "step" in r]
    report = json.loads((folder / "precision_report.json").read_text())
    return losses, report["bytes_per_param"], seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", default="debug_h64")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="/tmp/optimizer_precision")
    parser.add_argument("--output", help="also write the report (markdown) to this file")
    parser.add_argument("--json", help="also write each choice's per-step losses (JSON) to this file")
    a = parser.parse_args(argv)
    common = [
        *use_model(a.model),
        "--training.steps",
        str(a.steps),
        "--training.seq_len",
        str(a.seq_len),
        "--training.local_batch_size",
        str(a.batch),
        "--optimizer.lr",
        str(a.lr),
        "--lr_scheduler.warmup_steps",
        "20",
        "--lr_scheduler.decay_type",
        "cosine",
        "--lr_scheduler.min_lr_factor",
        "0.1",
        "--metrics.log_freq",
        "1",
        "--training.gc_freq",
        "0",
    ]
    curves = {name: curve(name, [*common, *args], Path(a.out)) for name, args in CHOICES.items()}
    ref = curves["fp32"][0]
    marks = [s for s in (1, 10, 50, 100, 200, a.steps) if s <= a.steps]
    rows = []
    for name, (losses, bpp, seconds) in curves.items():
        dev = [abs(x - y) for x, y in zip(losses, ref)]
        rows.append(
            [
                name,
                *(f"{losses[s - 1]:.4f}" for s in marks),
                f"{statistics.mean(losses[-50:]):.4f}",
                f"{max(dev):.4f}",
                f"{statistics.mean(dev):.4f}",
                f"{bpp['trained_total']} B",
                f"{seconds:.0f} s",
            ]
        )
    command = f"python -m benchmarks.optimizer_precision {shlex.join(sys.argv[1:] if argv is None else argv)}"
    settings = (
        f"model {a.model}, seq {a.seq_len} x batch {a.batch}, AdamW lr {a.lr} (20 warm-up steps, cosine to "
        f"0.1x), {a.steps} steps, one process"
    )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "settings": settings,
                    "machine": machine(),
                    "date": time.strftime("%Y-%m-%d"),
                    "curves": {
                        name: {"losses": losses, "bytes_per_param": bpp["trained_total"], "wall_s": round(seconds, 1)}
                        for name, (losses, bpp, seconds) in curves.items()
                    },
                },
                indent=1,
            )
            + "\n"
        )
    text = "\n".join(
        [
            header("Weight and optimizer-state precision: loss curves against fp32"),
            f"command: {command}",
            f"{settings}\n",
            md_table(
                [
                    "choice",
                    *(f"loss @{s}" for s in marks),
                    "mean of last 50",
                    "max |dev| vs fp32",
                    "mean |dev| vs fp32",
                    "bytes / trained param",
                    "wall",
                ],
                rows,
            ),
        ]
    )
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
