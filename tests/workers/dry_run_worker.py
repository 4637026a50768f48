"""Measures what the dry run predicts, in real runs: for tests/test_dry_run.py.

Usage: torchrun --nproc_per_node N dry_run_worker.py SPEC.json (tests/support/launch.py's spec: jobs of
{"name": str, "args": [CLI overrides]}, no options). For each job every rank builds `Trainer(load_config(args))`,
runs one train step (warm-up: lazy init, pipeline shape inference), then counts one more step:

- bytes of its parameters, gradients and optimizer state, by dtype (DTensors: local shards);
- under PP, what a rank holds across microbatches (tests/workers/pp_held.py);
- bytes of every collective it issues, by category and dtype (torchtitan_amp/observability/traffic.py: the
  torch.distributed, point-to-point and functional-collective entry points, and torch's
  `allreduce_hook` on DDP without a compress hook so that its C++ all-reduce is seen too; here:
  expert parallel's all-to-alls, both ways).

Volumes follow the dry run's convention: all-gather output, reduce-scatter input, all-reduce
buffer, point-to-point tensor. Rank 0 writes {job name: [per-rank result, ...]} to OUT/result.json.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.support.launch import exit_process, read_spec
from tests.workers.pp_held import PipelineHeld
from torchtitan_amp.config import load_config
from torchtitan_amp.observability import traffic as collectives
from torchtitan_amp.train import build as train_build
from torchtitan_amp.train import trainer as trainer_module
from torchtitan_amp.train.trainer import Trainer

_state = threading.local()
GROUP_DIMS: dict[tuple[int, ...], str] = {}  # ranks of a process group -> mesh dim
HSDP = {"on": False}
EP: dict[str, tuple[int, ...] | None] = {"ranks": None}  # the EP group's ranks (may be FSDP's too)


def _group_ranks(group) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    """Groups are identified by their ranks, not their objects: DTensor may run a collective on
    an equivalent group of an earlier job's mesh."""
    pg = dist.distributed_c10d._resolve_process_group(collectives.group_name(group))
    return tuple(sorted(dist.get_process_group_ranks(pg)))


def _category(op: str, group) -> str:  # type: ignore[no-untyped-def]
    dim = GROUP_DIMS.get(_group_ranks(group), "other")
    phase = getattr(_state, "phase", None)
    if phase:
        return f"{phase}:{op}:{dim}"
    if dim == "dp_shard" and op in ("all_gather", "reduce_scatter"):
        return f"fsdp_{op}"
    if dim == "dp_replicate" and op == "all_reduce":
        return "hsdp_all_reduce" if HSDP["on"] else "ddp_all_reduce"
    if dim == "tp" and op in ("all_gather", "reduce_scatter", "all_reduce"):
        return f"tp_{op}"
    if dim == "cp" and op in ("all_gather", "reduce_scatter"):
        return f"cp_{op}"
    if op == "all_to_all" and _group_ranks(group) == EP["ranks"]:
        return "ep_all_to_all"
    if dim == "efsdp" and op in ("all_gather", "reduce_scatter"):
        return f"expert_fsdp_{op}"
    if dim == "pp" and op in ("send", "recv", "all_reduce"):
        return f"pp_{op}"
    return f"other:{op}:{dim}"


def _in_phase(fn, phase: str):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    def tagged(*args, **kwargs):  # type: ignore[no-untyped-def]
        _state.phase = phase
        try:
            return fn(*args, **kwargs)
        finally:
            _state.phase = None

    return tagged


def install_phase_tags() -> None:
    """Collectives of the gradient-norm computation and of the optimizer step (DTensor scalars,
    Partial gradients) are tagged "grad_norm:..." / "optimizer:...", and so are those of a
    family's per-step state update ("after_backward:...": MoE's token counts summed over the
    data ranks, its load metrics over the stages), and the step's count of valid labels summed
    over the data ranks ("label_count:...", 8 bytes): the dry run reports the forward/backward
    traffic."""
    from torchtitan_amp.models import FAMILIES

    trainer_module.clip_grad_norm_ = _in_phase(trainer_module.clip_grad_norm_, "grad_norm")
    trainer_module.count_valid_labels = _in_phase(trainer_module.count_valid_labels, "label_count")
    for name, family in FAMILIES.items():
        if family.after_backward is not None:
            FAMILIES[name] = dataclasses.replace(
                family, after_backward=_in_phase(family.after_backward, "after_backward")
            )


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts the gradient the all-to-all's backward sends (torch's
    autograd all-to-all runs its reverse exchange in C++, out of the wrappers' sight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        if collectives._settings["on"]:
            collectives.record("all_to_all", ctx.group, grad)
        return grad, None


def install_all_to_all_counters() -> None:
    """Expert parallel's exchanges: the split sizes (dist.all_to_all_single) and the rows
    (expert_parallel's autograd all-to-all, both ways); volume = the tensor a rank sends."""
    from torchtitan_amp.distributed import expert_parallel

    counts_a2a, rows_a2a = dist.all_to_all_single, expert_parallel.all_to_all_single_autograd

    def count_splits(output, input, *args, **kwargs):  # type: ignore[no-untyped-def]
        if collectives._settings["on"]:
            collectives.record("all_to_all", kwargs.get("group"), input)
        return counts_a2a(output, input, *args, **kwargs)

    def count_rows(rows, output_split, input_split, group):  # type: ignore[no-untyped-def]
        if collectives._settings["on"]:
            collectives.record("all_to_all", group, rows)
        return _CountBackward.apply(rows_a2a(rows, output_split, input_split, group), group)

    dist.all_to_all_single = count_splits
    expert_parallel.all_to_all_single_autograd = count_rows


def _by_dtype(tensors) -> dict[str, int]:  # type: ignore[no-untyped-def]
    out: dict[str, int] = defaultdict(int)
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        out[str(local.dtype).removeprefix("torch.")] += local.numel() * local.element_size()
    return dict(out)


def run_job(args: list[str]) -> dict:
    trainer = Trainer(load_config(args))
    trainer.run.optimizer.step = _in_phase(trainer.run.optimizer.step, "optimizer")
    GROUP_DIMS.clear()
    if trainer.run.info.world_size > 1:
        for dim in ("pp", "dp_replicate", "dp_shard", "tp", "cp"):
            if getattr(trainer.run.dims, dim) > 1:
                GROUP_DIMS[_group_ranks(trainer.run.dims.mesh[dim].get_group())] = dim
        if trainer.run.dims.cp_enabled:
            # FSDP shards over dp_shard x cp: its group is neither dim's. Groups are told apart by
            # their ranks, so a layout whose FSDP group has the cp group's ranks cannot be counted.
            fsdp = trainer.run.dims.get_mesh("fsdp")
            ranks = _group_ranks((fsdp["dp_shard_cp"] if trainer.run.dims.hsdp_enabled else fsdp).get_group())
            assert ranks not in GROUP_DIMS, f"FSDP's group {ranks} is also the {GROUP_DIMS[ranks]} group's"
            GROUP_DIMS[ranks] = "dp_shard"
    HSDP["on"] = trainer.run.dims.hsdp_enabled
    EP["ranks"] = _group_ranks(trainer.run.dims.get_mesh("ep").get_group()) if trainer.run.dims.ep_enabled else None
    if trainer.run.dims.ep_enabled and trainer.run.dims.efsdp > 1:
        efsdp = trainer.run.dims.get_mesh("expert_fsdp")
        ranks = _group_ranks((efsdp["efsdp"] if trainer.run.dims.hsdp_enabled else efsdp).get_group())
        assert ranks not in GROUP_DIMS, f"the experts' FSDP group {ranks} is also the {GROUP_DIMS[ranks]} group's"
        GROUP_DIMS[ranks] = "efsdp"
    with torch.random.fork_rng(devices=[]):
        batches = iter(trainer.run.dataloader)
    held = PipelineHeld(trainer) if trainer.run.pipeline is not None else None
    trainer.train_step(batches)  # warm-up: lazy init, pipeline shape inference
    if held is not None:
        held.on = True
    with collectives.counting():
        trainer.train_step(batches)
    if held is not None:
        held.on = False
    params = [p for part in trainer.run.model_parts for p in part.parameters()]
    state = [t for s in trainer.run.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    result = {
        "params": _by_dtype(params),
        "grads": _by_dtype(p.grad for p in params if p.grad is not None),
        "optimizer": _by_dtype(state),
        "comm": collectives.snapshot(),
        "comm_calls": collectives.call_counts(),
        "pp_rank": trainer.run.dims.mesh["pp"].get_local_rank() if trainer.run.dims.pp_enabled else 0,
        "pp_held": None
        if held is None
        else {"in_flight": {str(k): v for k, v in held.in_flight.items()}, "fsdp": held.fsdp},
    }
    if os.environ.get("DRY_RUN_WORKER_LOG"):
        result["calls"] = list(collectives.CALLS)
        result["grad_shapes"] = {
            n: [
                list(p.shape),
                list((p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).shape),
                str(getattr(p.grad, "placements", "")),
            ]
            for part in trainer.run.model_parts
            for n, p in part.named_parameters()
            if p.grad is not None and "layers.1" not in n and "layers.2" not in n
        }
    trainer.run.metrics.close()
    return result


def fast_init() -> None:
    """Byte counts do not depend on weight values; trunc_normal_ is most of a debug model's
    build time on CPU, so fill with plain normal_ instead."""
    torch.nn.init.trunc_normal_ = lambda t, mean=0.0, std=1.0, a=-2.0, b=2.0: t.detach().normal_(mean, std)


def main(spec_path: str) -> int:
    fast_init()
    train_build.peak_flops = lambda device, dtype: 1e12  # MFU's timed matmuls: never read here
    collectives.install(
        _category, point_to_point=True, functional=True, record_calls=bool(os.environ.get("DRY_RUN_WORKER_LOG"))
    )
    collectives.install_default_ddp_hook()
    install_phase_tags()
    install_all_to_all_counters()
    spec = read_spec(spec_path)
    results = {}
    for job in spec.jobs:
        result = run_job(job["args"])
        if dist.is_initialized():
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
        else:
            gathered = [result]
        results[job["name"]] = gathered
    if not dist.is_initialized() or dist.get_rank() == 0:
        (spec.out / "result.json").write_text(json.dumps(results, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
