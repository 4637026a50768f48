"""Test worker: run one training step inside torchrun and dump what each rank saw and computed.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/first_step.py \
        --job.dump_folder DIR [--section.key value ...]

Writes DIR/first_step_rank{R}.pt with: the rank's first batch (`inputs`, `labels`, `batch_sha256`),
its local `loss`, the global `grad_norm`, and `grads` (name -> full fp32 gradient after the
data-parallel reduction; FSDP shards are gathered) and, under FSDP, `shard_grads` (name -> this
rank's own shard of it, as the rank holds it after the reduce-scatter). On the DDP path it first runs the same batch
without gradient sync and stores those per-rank gradients as `local_grads`. With
WORKER_TRAIN=1 it then continues with Trainer.train() up to training.steps (metrics.jsonl has
steps 2..training.steps).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from tests.support.launch import exit_process
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.train.trainer import Trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).float().clone()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Every rank walks the same names in the same order: full_tensor() is a collective.
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def main(argv: list[str]) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"[rank{os.environ.get('RANK', '0')}] %(message)s", stream=sys.stdout
    )
    trainer = Trainer(load_config(argv))
    inputs, labels = next(iter(trainer.run.dataloader))
    out: dict = {
        "rank": trainer.run.info.rank,
        "world_size": trainer.run.info.world_size,
        "ddp": trainer.run.dims.ddp_enabled,
        "fsdp": trainer.run.dims.fsdp_enabled,
        "path": trainer.run.plan.path,
        "inputs": inputs.clone(),
        "labels": labels.clone(),
        "batch_sha256": hashlib.sha256(inputs.numpy().tobytes()).hexdigest(),
    }
    if trainer.run.dims.ddp_enabled:
        trainer.run.model.set_requires_gradient_sync(False)
        trainer.forward_backward(inputs, labels)
        out["local_grads"] = _grads(trainer.run.model)
        trainer.run.optimizer.zero_grad(set_to_none=True)
    # The real step (sync back on for its last micro-batch) on the same batch.
    loss, grad_norm, stepped = trainer.train_step(iter([(inputs, labels)] * trainer.run.accum))
    out.update(loss=float(loss), grad_norm=float(grad_norm), stepped=bool(stepped), grads=_grads(trainer.run.model))
    if trainer.run.dims.fsdp_enabled:
        out["shard_grads"] = {
            n: p.grad.detach().to_local().float().clone()
            for n, p in trainer.run.model.named_parameters()
            if isinstance(p.grad, DTensor)
        }
    folder = Path(trainer.config.job.dump_folder)
    torch.save(out, folder / f"first_step_rank{trainer.run.info.rank}.pt")
    if os.environ.get("WORKER_TRAIN") == "1":
        # The step above was step 1 (it advanced the LR schedule); train() logs steps 2..steps.
        trainer.step = 1
        trainer.train()
    process_groups.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_process(0)
