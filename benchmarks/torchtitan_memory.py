#!/usr/bin/env python3
"""Memory per GPU at torchtitan's own published layouts: their measured number against our dry run.

    python -m benchmarks.torchtitan_memory              # every row: 37 dry runs, ~75 s of CPU time
    python -m benchmarks.torchtitan_memory --rows 0,4   # some rows, by index

torchtitan's numbers are from pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md
(Llama 3.1 on H100s, 2024-12): the *maximum reserved* memory per GPU (the CUDA caching allocator's,
the maximum over all GPUs of the job). Ours is the dry run's (torchtitan_amp/train/dry_run.py) *allocated*
peak of the configured AC mode (tensors alive at the peak; no allocator cache or fragmentation):
reserved >= allocated, so a ratio above 1 means this framework would hold more than torchtitan
did. Under PP the row takes the largest of the pp ranks (one dry run per pp coordinate), as
torchtitan's footnote does, with torchtitan's microbatch count for those runs (pp x stages per
rank). Every dry run sizes a CUDA target (dry_run.device = "cuda"), with the bf16 FSDP policy (fp32
master weights, fp32 gradient reduction) and Llama 3's vocabulary (128256). Where torchtitan ran
Float8 we run fp8 (tensorwise; with fp8 all-gather where their config had it); torch.compile and
async TP are not modelled (our estimate is the eager peak).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from torchtitan_amp.core.rules import STAGES_PER_RANK
from torchtitan_amp.tools.memory_table import Row, build_table, dry_run_peak

REPO = Path(__file__).resolve().parent.parent
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
FP8 = ("--mixed_precision.fp8", "tensorwise")
FP8_AG = (*FP8, "--mixed_precision.fp8_all_gather", "true")


def _config(name: str) -> str:
    return str(REPO / "train_configs" / f"{name}.toml")


def _layout(
    shard: int, *, tp: int = 1, pp: int = 1, cp: int = 1, lb: int, seq: int, ac: str, schedule: str = "1F1B"
) -> tuple[str, ...]:
    out = [
        "--parallelism.data_parallel_shard_degree",
        str(shard),
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--parallelism.pipeline_parallel_degree",
        str(pp),
        "--parallelism.context_parallel_degree",
        str(cp),
        "--training.local_batch_size",
        str(lb),
        "--training.seq_len",
        str(seq),
        "--activation_checkpoint.mode",
        "full" if ac == "full" else "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    if pp > 1:
        # torchtitan's default then (pipeline_parallel_microbatches unset): one microbatch per
        # stage of the whole pipeline, pp x stages per rank.
        microbatches = pp * STAGES_PER_RANK[schedule]
        out += [
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            "--parallelism.pipeline_parallel_microbatch_size",
            str(lb // microbatches),
        ]
    return tuple(out)


# Their Tables 1 and 3 (eager FSDP rows), 2 (compile + Float8), 4-6 (compile + Float8 with float8
# all-gather, their 70B/405B configs' setting; Tables 5-6 add async TP).
ROWS: tuple[Row, ...] = (
    Row(
        "8B, FSDP 8, local batch 2, seq 8192, selective op AC",
        82.4,
        _config("llama3_8b"),
        8,
        _layout(8, lb=2, seq=8192, ac="op"),
        "eager; ours eager",
    ),
    Row(
        "8B, FSDP 128, local batch 2, seq 8192, selective op AC",
        67.0,
        _config("llama3_8b"),
        128,
        _layout(128, lb=2, seq=8192, ac="op"),
        "eager; ours eager",
    ),
    Row(
        "8B, FSDP 8 / CP 1, seq 32768, local batch 1, full AC",
        83.9,
        _config("llama3_8b"),
        8,
        _layout(8, lb=1, seq=32768, ac="full") + FP8,
        "compile + Float8; ours fp8",
    ),
    Row(
        "8B, FSDP 1 / CP 8, seq 262144, local batch 1, full AC",
        84.5,
        _config("llama3_8b"),
        8,
        _layout(1, cp=8, lb=1, seq=262144, ac="full") + FP8,
        "compile + Float8; ours fp8",
    ),
    Row(
        "70B, FSDP 32 x TP 8, local batch 16, seq 8192, full AC",
        71.9,
        _config("llama3_70b"),
        256,
        _layout(32, tp=8, lb=16, seq=8192, ac="full") + FP8_AG,
        "compile + Float8 (fp8 all-gather); ours the same",
    ),
    Row(
        "405B, FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32, seq 8192, full AC",
        82.5,
        _config("llama3_405b"),
        512,
        _layout(8, tp=8, pp=8, lb=32, seq=8192, ac="full") + FP8_AG,
        "compile + Float8 (fp8 all-gather) + async TP; ours fp8 + fp8 all-gather",
    ),
    Row(
        "405B, same, Interleaved 1F1B",
        72.7,
        _config("llama3_405b"),
        512,
        _layout(8, tp=8, pp=8, lb=32, seq=8192, ac="full", schedule="Interleaved1F1B") + FP8_AG,
        "compile + Float8 (fp8 all-gather) + async TP; ours fp8 + fp8 all-gather",
    ),
    Row(
        "405B, FSDP 8 x TP 8 x PP 8, 1F1B, seq 32768, local batch 8, full AC",
        75.3,
        _config("llama3_405b"),
        512,
        _layout(8, tp=8, pp=8, lb=8, seq=32768, ac="full") + FP8_AG,
        "compile + Float8 (fp8 all-gather) + async TP; ours fp8 + fp8 all-gather",
    ),
    Row(
        "405B, FSDP 1 x CP 8 x TP 8 x PP 8, 1F1B, seq 262144, local batch 8, full AC",
        84.9,
        _config("llama3_405b"),
        512,
        _layout(1, cp=8, tp=8, pp=8, lb=8, seq=262144, ac="full") + FP8_AG,
        "compile + Float8 (fp8 all-gather) + async TP; ours fp8 + fp8 all-gather",
    ),
)


def command(indices: list[int] | None) -> str:
    return "python -m benchmarks.torchtitan_memory" + (f" --rows {','.join(map(str, indices))}" if indices else "")


def run(indices: list[int] | None, tmp: str, peak: Callable[[Row, str], float] = dry_run_peak) -> str:
    rows = [ROWS[i] for i in indices] if indices else list(ROWS)
    return build_table([(row, peak(row, tmp)) for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    parser.add_argument("--dump-folder", default="outputs/torchtitan_memory")
    args = parser.parse_args(argv)
    indices = [int(i) for i in args.rows.split(",")] if args.rows else None
    logging.disable(logging.WARNING)  # the dry run's per-build log lines; the table is the output
    table = run(indices, args.dump_folder)
    print(f"Against {SOURCE}; ours: `{command(indices)}`\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
