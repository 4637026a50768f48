"""Test worker: train several parallel layouts one after another inside one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node N tests/workers/layouts.py SPEC.json

SPEC.json is tests/support.py's spec: {"out": DIR, "jobs": [{"name": NAME, "args": [...]}, ...]};
no options. Each run builds a fresh `Trainer` from its args (plus --job.dump_folder DIR/NAME) and calls
`train()`, exactly what train.py does (torchtitan_amp.trainer.train_in_turn, shared with
torchtitan_amp/tools/numerics_matrix.py); process start-up (~5 s per launch on a 2-core CPU) is paid once for
all of them. Per run, after training, every rank writes DIR/NAME/rank{R}.json with its
mesh coordinates, data-parallel rank and what AC / compile wrapped; rank 0's metrics.jsonl and
precision_report.json land there as usual. A run that raises writes DIR/NAME/error_rank{R}.txt and
stops the launch (later runs do not start).
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from torchtitan_amp import distributed
from torchtitan_amp.trainer import Trainer, train_in_turn
from tests.support import digest, exit_process, read_spec


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _replicated(p: torch.Tensor) -> bool:
    return not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)


def _rank_info(trainer: Trainer) -> dict:
    dims = trainer.dims
    modules = [(name, m) for part in trainer.model_parts for name, m in part.named_modules()]
    info = {"rank": trainer.info.rank, "world_size": trainer.info.world_size,
            "degrees": {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                        "tp": dims.tp},
            "dp_rank": trainer.dataloader.dp_rank, "dp_world_size": trainer.dataloader.dp_world_size,
            "path": trainer.plan.path,
            # What AC and compile did to the model, so their tests cannot pass on an unwrapped model.
            "checkpoint_wrapped": [n for n, m in modules if isinstance(m, CheckpointWrapper)],
            "compiled": [n for n, m in modules if getattr(m, "_compiled_call_impl", None) is not None],
            "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
            # AdamW's moments as this rank holds them, and a digest of its replicated parameters
            # (plain tensors, or DTensors replicated on every mesh dim): equal across replicas.
            "frozen_params": sorted(n for part in trainer.model_parts for n, p in part.named_parameters()
                                    if not p.requires_grad),
            "optimizer_state_dtypes": sorted({str(_local(s[k]).dtype).removeprefix("torch.")
                                              for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")}),
            "replicated_params_digest": digest(torch.cat([_local(p).detach().float().flatten()
                                                          for part in trainer.model_parts for p in part.parameters()
                                                          if _replicated(p)] or [torch.zeros(0)]))}
    if trainer.info.world_size > 1:
        mesh = dims.mesh
        info["mesh_dim_names"] = list(mesh.mesh_dim_names)
        info["mesh_shape"] = list(mesh.shape)
        info["coordinate"] = list(mesh.get_coordinate())
        info["dp_mesh_size"] = dims.dp_mesh.size()
    return info


def main(spec_path: str) -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"[rank{rank}] %(message)s", stream=sys.stdout, force=True)
    spec = read_spec(spec_path)
    out, runs = spec.out, spec.jobs
    for i, wall_s in train_in_turn([(out / run["name"], run["args"]) for run in runs], inspect=_rank_info):
        if rank == "0":
            (out / runs[i]["name"] / "wall_s.txt").write_text(f"{wall_s:.2f}\n")
            print(f"[layouts] {runs[i]['name']} done in {wall_s:.1f} s", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
