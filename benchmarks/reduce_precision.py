#!/usr/bin/env python3
"""How much a bf16 (or fp16) gradient reduce loses as the data-parallel degree grows: an emulation.

The CPU suite can run 4 ranks, not 64, so this computes N real per-rank gradients of the debug
model (one batch each, one process) and reduces them the way the wire does:

- `reduce_dtype = float32`: the exact mean (the reference);
- `reduce_dtype = bfloat16 / float16`, as our DDP compress hook does it: every rank divides its
  gradient by N and casts it, then a ring all-reduce adds the N contributions one hop at a time,
  rounding the running sum to the reduce dtype after every hop (NCCL's ring adds in fp32 and
  stores each hop's partial sum in the wire dtype). FSDP's bf16 reduce-scatter has the same shape.

For N = 1, 2, 4, ... it prints the relative L2 error of the reduced gradient against the exact
fp32 mean, and the same for the one-time cast of the mean (the error a bf16 wire costs at
minimum). An emulation of the arithmetic, not a measurement of NCCL: ring order and partial-sum
placement differ in detail; the growth with N is the point.

    python -m benchmarks.reduce_precision [--max-ranks 64] [--model debug_h64]
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks._common import CPU_MODELS, header, md_table, use_model
from torchtitan_amp.config import load_config
from torchtitan_amp.train import trainer as trainer_module
from torchtitan_amp.train.trainer import Trainer, loss_fn

WIRE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def per_rank_gradients(model_name: str, n: int, seq_len: int, batch: int) -> list[torch.Tensor]:
    """n flat fp32 gradients of the same weights, each from its own batch of real data."""
    trainer_module.peak_flops = lambda device, dtype: 1e12  # MFU is not read here
    trainer = Trainer(
        load_config(
            [
                *use_model(model_name),
                "--mixed_precision.enabled",
                "false",
                "--training.seq_len",
                str(seq_len),
                "--training.local_batch_size",
                str(batch),
                "--job.dump_folder",
                "/tmp/reduce_precision",
            ]
        )
    )
    grads, batches = [], iter(trainer.run.dataloader)
    params = [p for p in trainer.run.model.parameters() if p.requires_grad]
    for _ in range(n):
        inputs, labels = next(batches)
        trainer.run.model.zero_grad(set_to_none=True)
        loss_fn(trainer.run.model(inputs), labels).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
    trainer.run.metrics.close()
    return grads


def ring_mean(grads: list[torch.Tensor], wire: torch.dtype) -> torch.Tensor:
    """Pre-divide, cast, then add hop by hop, rounding each partial sum to the wire dtype."""
    n = len(grads)
    acc = (grads[0] / n).to(wire)
    for g in grads[1:]:
        acc = (acc.float() + (g / n).to(wire).float()).to(wire)
    return acc.float()


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-ranks", type=int, default=64)
    p.add_argument("--model", default="debug_h64", choices=sorted(CPU_MODELS))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    a = p.parse_args(argv)
    if a.max_ranks < 1:
        p.error(f"--max-ranks must be >= 1, got {a.max_ranks}")
    torch.manual_seed(0)
    grads = per_rank_gradients(a.model, a.max_ranks, a.seq_len, a.batch)
    rows, n = [], 1
    while n <= a.max_ranks:
        exact = torch.stack(grads[:n]).double().mean(0).float()
        row: list[object] = [n]
        for wire in WIRE.values():
            row += [f"{rel_l2(exact.to(wire).float(), exact):.2e}", f"{rel_l2(ring_mean(grads[:n], wire), exact):.2e}"]
        rows.append(row)
        n *= 2
    print(
        header(
            f"Gradient reduce error vs data-parallel degree ({a.model}, {grads[0].numel():,} gradients, "
            f"batch {a.batch} x seq {a.seq_len} per rank; emulated ring)"
        )
    )
    print(
        md_table(
            ["ranks", "bf16: cast of the mean", "bf16 ring reduce", "fp16: cast of the mean", "fp16 ring reduce"], rows
        )
    )
    print(
        "\nRelative L2 error against the exact fp32 mean. 'cast of the mean' is the floor any "
        "low-precision wire costs; the ring's extra error is rounding of partial sums, once per hop."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
