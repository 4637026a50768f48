"""Test worker: train several parallel layouts one after another inside one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node N tests/workers/layouts.py SPEC.json

SPEC.json is tests/support/launch.py's spec: {"out": DIR, "jobs": [{"name": NAME, "args": [...]}, ...]};
one option, "flavors": {NAME: {"base": FLAVOR, field: value, ...}} registers llama3 flavors (FLAVOR's
args with those fields replaced) before the first run. Each run builds a fresh `Trainer` from its
args (plus --job.dump_folder DIR/NAME) and calls `train()`, exactly what train.py does
(torchtitan_amp.train.trainer.train_in_turn, shared with torchtitan_amp/tools/numerics_matrix.py);
process start-up (~5 s per launch on a 2-core CPU) is paid once for all of them. Per run, after
training, every rank writes DIR/NAME/rank{R}.json with its mesh coordinates, data-parallel rank and
what AC / compile wrapped, and evidence taken during the run: every step's gradient norm against an
independent fp64 one (tests/workers/norm_check.py), the frozen parameters' gradients, optimizer
state and digests before vs after training, the last step's full gradients for jobs marked "grads":
true (grads_rank{R}.pt), the valid-label counts of jobs marked "mask_labels": true (whose loader
labels are partly set to -100, `mask_labels`), and for stochastically rounded bf16 weights the
updates below half a bf16 ulp that moved a weight; rank 0's metrics.jsonl and precision_report.json
land there as usual. A run that raises writes DIR/NAME/error_rank{R}.txt and stops the launch (later
runs do not start).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from tests.support.inputs import mask_labels
from tests.support.launch import digest, exit_process, read_spec
from tests.workers import norm_check
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, register_flavor
from torchtitan_amp.models.moe.moe import MoE
from torchtitan_amp.observability.host_syncs import StepSyncs, uncounted
from torchtitan_amp.precision.tags import FROZEN
from torchtitan_amp.train import build as train_build
from torchtitan_amp.train import optim as optim_mod
from torchtitan_amp.train.trainer import Trainer, train_in_turn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _replicated(p: torch.Tensor) -> bool:
    return not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)


def _tp_replicated(p: torch.Tensor) -> bool:
    """A DTensor replicated over the tp mesh dim (sharded or not over the others): equal on the
    TP ranks of one data-parallel coordinate (an MoE layer's router and experts under TP)."""
    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    return "tp" in names and p.placements[names.index("tp")].is_replicate()


def _frozen_params(trainer: Trainer) -> dict[str, torch.nn.Parameter]:
    """The parameters of the modules training.freeze tagged (the tag, not requires_grad: a frozen
    module whose parameters came to require grad again is still listed)."""
    return {
        f"{mname}.{pname}" if mname else pname: p
        for part in trainer.run.model_parts
        for mname, m in part.named_modules()
        if getattr(m, FROZEN, False)
        for pname, p in m.named_parameters(recurse=False)
    }


class RoundingRecorder:
    """For bf16 weights updated by AdamWMixedState: the elements whose fp32 update was below half a
    bf16 ulp (round-to-nearest gives back the old weight) and whether the stored weight moved
    anyway. Only stochastic rounding moves them; nearest rounding never does.

    AdamWMixedState runs torch's AdamW math on an fp32 copy per parameter (optim.adam_step) and
    then rounds it into the stored weight: `record_target` keeps that fp32 result; the step hooks
    take the weights before and after. The optimizer updates exactly the parameters with a
    gradient, in param_groups order, so the i-th target belongs to the i-th such parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.targets: list[torch.Tensor] = []
        self.before: list[torch.Tensor] = []
        self.sub_half_ulp = 0  # updates below half an ulp, over all steps
        self.moved = 0  # of those, the elements whose stored weight changed
        self.example: dict[str, float] | None = None  # one such element: old, fp32 target, new
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _stepped(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _pre(self, *_: object) -> None:
        self.targets = []
        self.before = [_local(p).detach().clone() for p in self._stepped()]

    def record_target(self, p32: torch.Tensor) -> None:
        self.targets.append(p32.detach().clone())

    def _post(self, *_: object) -> None:
        with uncounted():  # evidence, not the step's host syncs (StepSyncs)
            self._compare()

    def _compare(self) -> None:
        after = [_local(p).detach() for p in self._stepped()]
        assert len(self.targets) == len(after) == len(self.before), (len(self.targets), len(after))
        for old, target, new in zip(self.before, self.targets, after):
            if old.dtype != torch.bfloat16:
                continue
            sub_half = (target.to(torch.bfloat16) == old) & (target != old.float())
            moved = sub_half & (new != old)
            self.sub_half_ulp += int(sub_half.sum())
            self.moved += int(moved.sum())
            if self.example is None and bool(moved.any()):
                i = int(moved.flatten().nonzero()[0])
                self.example = {
                    "old": float(old.flatten()[i]),
                    "target": float(target.flatten()[i]),
                    "new": float(new.flatten()[i]),
                }

    def as_dict(self) -> dict:
        return {"sub_half_ulp": self.sub_half_ulp, "moved": self.moved, "example": self.example}


@dataclass
class RunEvidence:
    """What a run records before and during train(); reset at the start of each run."""

    frozen_digests: dict[str, str] = field(default_factory=dict)
    rounding: RoundingRecorder | None = None
    # The host syncs of the run's second step (the first may build lazily), with their lines.
    syncs: StepSyncs | None = None
    valid_labels: list[int] = field(default_factory=list)  # per loader batch, "mask_labels" runs


def _mask_train_labels(trainer: Trainer) -> None:
    """Every loader batch of this run's train steps through `mask_labels`, its count recorded."""
    step = trainer.train_step

    def masked_step(batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> object:
        def masked() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for inputs, labels in batches:
                with uncounted():  # the harness's reads, not the step's host syncs
                    labels = mask_labels(labels)
                    _run.valid_labels.append(int((labels != -100).sum()))
                yield inputs, labels

        return step(masked())

    trainer.train_step = masked_step  # type: ignore[method-assign]


_run = RunEvidence()
_train = Trainer.train
_adam_step = optim_mod.adam_step


def _recording_adam_step(params: list[torch.Tensor], *args: object, **kwargs: object) -> None:
    _adam_step(params, *args, **kwargs)
    if _run.rounding is not None:
        _run.rounding.record_target(params[0])


def _train_with_evidence(trainer: Trainer) -> None:
    global _run
    norm_check.reset()
    # Whatever the optimizer's own flag says: the evidence must not take the rounding mode's word.
    rounding = None
    if isinstance(trainer.run.optimizer, optim_mod.AdamWMixedState) and any(
        _local(p).dtype == torch.bfloat16 for p in trainer.run.params
    ):
        rounding = RoundingRecorder(trainer.run.optimizer)
    # Not under compile: a compiled region's host reads are graph breaks (tests/test_host_syncs.py
    # explains a compiled MoE block), and a dispatch mode would make dynamo retrace the blocks.
    syncs = None if trainer.config.compile.enable else StepSyncs(only={trainer.step + 2}, where=True)
    _run = RunEvidence({n: digest(_local(p)) for n, p in _frozen_params(trainer).items()}, rounding, syncs)
    if Path(trainer.config.job.dump_folder).name in _MASK_RUNS:  # first: the grads wrapper keeps it
        _mask_train_labels(trainer)
    if syncs is not None:
        syncs.install(trainer)
    if Path(trainer.config.job.dump_folder).name in _GRAD_RUNS:
        _save_grads_after_first_step(trainer)
    try:
        _train(trainer)
    finally:
        if syncs is not None:
            syncs.finish()


def _frozen_info(trainer: Trainer) -> dict[str, dict]:
    """Per frozen parameter: what a frozen parameter must (not) have after training."""
    in_groups = {id(p) for g in trainer.run.optimizer.param_groups for p in g["params"]}
    return {
        n: {
            "requires_grad": p.requires_grad,
            "grad_is_none": p.grad is None,
            "in_optimizer": id(p) in in_groups,
            "has_optimizer_state": p in trainer.run.optimizer.state,
            "digest_unchanged": digest(_local(p)) == _run.frozen_digests.get(n),
        }
        for n, p in _frozen_params(trainer).items()
    }


# Runs whose spec job says "grads": true also write DIR/NAME/grads_rank{R}.pt: every parameter this
# rank holds, by its model name, with its full gradient of step 1 (the same weights and batch in
# every layout; later steps' weights have moved apart through AdamW's normalisation of tiny
# gradients). FSDP / TP shards gathered: every rank of the run takes part in those collectives.
_GRAD_RUNS: set[str] = set()
# Runs whose spec job says "mask_labels": true train on labels partly set to -100 (mask_labels).
_MASK_RUNS: set[str] = set()


def _save_grads(trainer: Trainer) -> None:
    grads = {}
    for part in trainer.run.model_parts:
        for name, p in part.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[process_groups.unwrapped_name(name)] = grad.detach().float().clone()
    folder = Path(trainer.config.job.dump_folder)
    torch.save(grads, folder / f"grads_rank{trainer.run.info.rank}.pt")


def _save_grads_after_first_step(trainer: Trainer) -> None:
    step = trainer.train_step

    def first_step_then_save(*args: object, **kwargs: object) -> object:
        result = step(*args, **kwargs)
        _save_grads(trainer)
        trainer.train_step = step  # type: ignore[method-assign]
        return result

    trainer.train_step = first_step_then_save  # type: ignore[method-assign]


def _rank_info(trainer: Trainer) -> dict:
    dims = trainer.run.dims
    modules = [(name, m) for part in trainer.run.model_parts for name, m in part.named_modules()]
    info = {
        "rank": trainer.run.info.rank,
        "world_size": trainer.run.info.world_size,
        "degrees": {
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "tp": dims.tp,
        },
        "dp_rank": trainer.run.dataloader.dp_rank,
        "dp_world_size": trainer.run.dataloader.dp_world_size,
        "tokens_seen": trainer.tokens_seen,
        "path": trainer.run.plan.path,
        # What AC and compile did to the model, so their tests cannot pass on an unwrapped model.
        "checkpoint_wrapped": [n for n, m in modules if isinstance(m, CheckpointWrapper)],
        "compiled": [n for n, m in modules if getattr(m, "_compiled_call_impl", None) is not None],
        "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
        # AdamW's moments as this rank holds them, and a digest of its replicated parameters
        # (plain tensors, or DTensors replicated on every mesh dim): equal across replicas.
        "frozen_params": sorted(
            n for part in trainer.run.model_parts for n, p in part.named_parameters() if not p.requires_grad
        ),
        "optimizer_state_dtypes": sorted(
            {
                str(_local(s[k]).dtype).removeprefix("torch.")
                for s in trainer.run.optimizer.state.values()
                for k in ("exp_avg", "exp_avg_sq")
            }
        ),
        "replicated_params_digest": digest(
            torch.cat(
                [
                    _local(p).detach().float().flatten()
                    for part in trainer.run.model_parts
                    for p in part.parameters()
                    if _replicated(p)
                ]
                or [torch.zeros(0)]
            )
        ),
        # The same for parameters replicated over tp only: equal across the TP ranks.
        "tp_replicated_params": sorted(
            n for part in trainer.run.model_parts for n, p in part.named_parameters() if _tp_replicated(p)
        ),
        "tp_replicated_params_digest": digest(
            torch.cat(
                [
                    _local(p).detach().float().flatten()
                    for part in trainer.run.model_parts
                    for p in part.parameters()
                    if _tp_replicated(p)
                ]
                or [torch.zeros(0)]
            )
        ),
        "norm_check": norm_check.records(),
        # enable_weight_tying: the output layer's weight is still the embedding table's object
        "output_tied": [
            getattr(p, "output", None) is not None
            and getattr(p, "tok_embeddings", None) is not None
            and p.output.weight is p.tok_embeddings.weight
            for p in trainer.run.model_parts
        ],
        "frozen": _frozen_info(trainer),
        "rounding": _run.rounding.as_dict() if _run.rounding is not None else None,
        "valid_labels": _run.valid_labels,
        "host_syncs": {str(s): r for s, r in _run.syncs.steps.items()} if _run.syncs is not None else {},
        # What the host-sync budget scales with: MoE layers dispatching by expert parallel on
        # this rank, and forwards per layer and step (accumulation x pipeline microbatches).
        "ep_layers": sum(
            isinstance(m, MoE) and m.expert_parallel is not None  # not its AC wrapper
            for part in trainer.run.model_parts
            for m in part.modules()
        ),
        "forwards_per_step": trainer.run.accum * (trainer.run.pipeline.n_microbatches if trainer.run.pipeline else 1),
        # fp16 with a non-fused AdamW: GradScaler.step reads found_inf itself (one more read).
        "scaler_reads_found_inf": trainer.run.scaler.enabled
        and not any(g.get("fused") for g in trainer.run.optimizer.param_groups),
        # ShardedGradScaler.update with its scale on the CPU runs a Python path that reads
        # found_inf and the growth tracker (2); on CUDA it runs torch._amp_update_scale_ (none).
        "cpu_only_scaler_reads": 2
        if type(trainer.run.scaler.scaler).__name__ == "ShardedGradScaler" and trainer.run.device.type == "cpu"
        else 0,
    }
    if trainer.run.info.world_size > 1:
        mesh = dims.mesh
        info["mesh_dim_names"] = list(mesh.mesh_dim_names)
        info["mesh_shape"] = list(mesh.shape)
        info["coordinate"] = list(mesh.get_coordinate())
        info["dp_mesh_size"] = dims.get_mesh("dp").size()
    return info


def main(spec_path: str) -> None:
    # MFU's CPU peak (a timed matmul per dtype, ~0.4 s each, every process) is never read here.
    train_build.peak_flops = lambda device, dtype: 1e12
    norm_check.install()
    Trainer.train = _train_with_evidence  # type: ignore[method-assign]
    optim_mod.adam_step = _recording_adam_step  # type: ignore[assignment]
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"[rank{rank}] %(message)s",
        stream=sys.stdout,
        force=True,
    )
    spec = read_spec(spec_path)
    for name, fields in spec.options.get("flavors", {}).items():
        fields = dict(fields)
        register_flavor(name, dataclasses.replace(LLAMA3_FLAVORS[fields.pop("base")], **fields))
    out, runs = spec.out, spec.jobs
    _GRAD_RUNS.update(run["name"] for run in runs if run.get("grads"))
    _MASK_RUNS.update(run["name"] for run in runs if run.get("mask_labels"))
    for i, wall_s in train_in_turn([(out / run["name"], run["args"]) for run in runs], inspect=_rank_info):
        if rank == "0":
            (out / runs[i]["name"] / "wall_s.txt").write_text(f"{wall_s:.2f}\n")
            print(f"[layouts] {runs[i]['name']} done in {wall_s:.1f} s", flush=True)
    process_groups.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
