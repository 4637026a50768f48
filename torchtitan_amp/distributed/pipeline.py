"""Pipeline parallel: split the Llama model into stages and build a torch.distributed.pipelining schedule."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_amp.config import ConfigError, ParallelismConfig
from torchtitan_amp.core.rules import STAGES_PER_RANK, even_stage_starts
from torchtitan_amp.distributed.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

logger = logging.getLogger("torchtitan_amp")


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _ModalLoss:
    """The one loss function a schedule holds, switched between training's (scaled, weighted by
    the step's count of valid labels) and evaluation's (the plain sum over valid labels)."""

    def __init__(self, train: LossFn, evaluate: LossFn) -> None:
        self.train, self.evaluate, self.evaluating = train, evaluate, False

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (self.evaluate if self.evaluating else self.train)(output, labels)


@dataclass
class Pipeline:
    schedule: _PipelineSchedule
    model_parts: list[nn.Module]
    has_first_stage: bool
    has_last_stage: bool
    n_microbatches: int
    loss: _ModalLoss

    def step(
        self, inputs: torch.Tensor, labels: torch.Tensor, forward_labels: bool = False, **extra: torch.Tensor
    ) -> list[torch.Tensor]:
        """Forward + backward of one batch; returns the last stage's per-microbatch losses.

        Args:
            inputs: [B, S] token ids (the first stage's input).
            labels: [B, S] targets (the last stage's loss).
            forward_labels: True to hand every stage's forward the labels too, as `labels` (a
                model that adds losses of its own from them: models/spec.py's takes_labels).
            extra: keyword inputs of every stage's forward (e.g. doc_ids), split into
                microbatches like the inputs.
        """
        return self._run(
            self.schedule.step, inputs, labels, {**extra, **({"labels": labels} if forward_labels else {})}
        )

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, **extra: torch.Tensor) -> list[torch.Tensor]:
        """Forward only (the schedule's eval mode, every stage takes part): the last stage's
        per-microbatch losses as the evaluation loss function returns them (sums over valid
        labels); [] on the other stages."""
        self.loss.evaluating = True
        try:
            with torch.no_grad():
                return self._run(self.schedule.eval, inputs, labels, extra)
        finally:
            self.loss.evaluating = False

    def _run(
        self, run: Callable[..., object], inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        targets = labels if self.has_last_stage else None
        # Keyword inputs reach every stage (torch splits them per microbatch), positional ones the first.
        if self.has_first_stage:
            run(inputs, target=targets, losses=losses, return_outputs=False, **extra)
        else:
            run(target=targets, losses=losses, return_outputs=False, **extra)
        # Under loss parallel (TP) each loss is a replicated DTensor: hand back plain tensors.
        return [cast(DTensor, x.detach()).full_tensor() if isinstance(x, DTensor) else x.detach() for x in losses]


def stage_boundaries(n_layers: int, num_stages: int, split_points: list[str]) -> list[int]:
    """The first layer index of each pipeline stage; ConfigError for split points that do not
    name increasing layers, or more stages than layers.

    Args:
        n_layers: the model's transformer blocks.
        num_stages: how many stages the model is cut into.
        split_points: each later stage's first block as 'layers.N' (empty: an even split).
    """
    if split_points:
        try:
            starts = [int(s.removeprefix("layers.")) for s in split_points]
        except ValueError:
            raise ConfigError(
                f"'parallelism.pipeline_parallel_split_points' must look like 'layers.N', got {split_points}"
            ) from None
        if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or not 0 < starts[0] <= starts[-1] < n_layers:
            raise ConfigError(
                f"'parallelism.pipeline_parallel_split_points' needs {num_stages - 1} increasing "
                f"layer indices in 1..{n_layers - 1}, got {split_points}"
            )
        return [0] + starts
    if n_layers < num_stages:
        raise ConfigError(f"{num_stages} pipeline stages need at least as many layers; the model has {n_layers}")
    return even_stage_starts(n_layers, num_stages)


def stage_module(model: nn.Module, stage: int, boundaries: list[int]) -> nn.Module:
    """A copy of the model holding only one stage's layers (FQNs unchanged) and ends: the embedding
    on the first stage, the final norm, output and side blocks (`mtp`) on the last, None elsewhere.

    Args:
        model: the whole decoder (on meta or materialized); left unchanged.
        stage: the stage's index, 0 to len(boundaries) - 1.
        boundaries: every stage's first layer index (stage_boundaries).
    """
    n_layers = len(cast(nn.ModuleDict, model.layers))
    start = boundaries[stage]
    end = boundaries[stage + 1] if stage + 1 < len(boundaries) else n_layers
    # Any: the decoder shape of models/spec.py, whose ends a stage sets to None (nn.Module's stubs
    # allow only a Tensor or Module there).
    # A frozen tensor-subclass parameter (QLoRA's NF4 base) is the stage's own, not a copy: torchao's
    # NF4Tensor clones by dequantizing and requantizing in its default blocks, which a small
    # weight's block count does not divide and which would not be bitwise the base it quantized.
    shared = {id(p): p for p in model.parameters() if not p.requires_grad and type(p) is not nn.Parameter}
    part: Any = copy.deepcopy(model, shared)
    for i in range(n_layers):
        if not start <= i < end:
            del part.layers[str(i)]
    if stage != 0:
        part.tok_embeddings = None
    if stage != len(boundaries) - 1:
        part.norm = None
        part.output = None
        if getattr(part, "mtp", None) is not None:
            part.mtp = None  # side blocks (models/spec.py's `mtp`) run after the last layer: the last stage's
    return part


def validate_pipeline(
    dims: ParallelDims, p: ParallelismConfig, n_layers: int, local_batch_size: int
) -> tuple[list[int], int]:
    """Config-time checks of a pipeline layout; returns (stage boundaries, microbatch count).

    Args:
        dims: the parallel degrees (pp and the data-parallel ones).
        p: the parallelism config section: schedule, stages per rank, split points, microbatches.
        n_layers: the model's transformer blocks.
        local_batch_size: sequences per rank per step, which the microbatches divide.
    """
    stages_per_rank = STAGES_PER_RANK[p.pipeline_parallel_schedule]
    boundaries = stage_boundaries(n_layers, dims.pp * stages_per_rank, p.pipeline_parallel_split_points)
    if local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"'training.local_batch_size' = {local_batch_size} must be a multiple of "
            f"'parallelism.pipeline_parallel_microbatch_size' = {p.pipeline_parallel_microbatch_size}"
        )
    n_microbatches = local_batch_size // p.pipeline_parallel_microbatch_size
    if stages_per_rank > 1 and n_microbatches % dims.pp:
        raise ConfigError(
            f"{p.pipeline_parallel_schedule} needs the number of microbatches (local_batch_size / "
            f"microbatch_size = {n_microbatches}) to be a multiple of pipeline_parallel_degree = {dims.pp}"
        )
    if p.pipeline_fsdp_reduce == "per_microbatch" and not dims.fsdp_enabled:
        raise ConfigError(
            "'parallelism.pipeline_fsdp_reduce' = 'per_microbatch' chooses when FSDP reduces under "
            "pipeline parallel; this layout has no FSDP (data_parallel_shard_degree x "
            "context_parallel_degree = 1): leave it 'per_step'"
        )
    if p.pipeline_parallel_schedule == "1F1B" and n_microbatches < dims.pp:
        raise ConfigError(
            f"1F1B needs at least pipeline_parallel_degree = {dims.pp} microbatches, got "
            f"local_batch_size / microbatch_size = {n_microbatches}; raise training.local_batch_size "
            f"or use pipeline_parallel_schedule = 'GPipe'"
        )
    return boundaries, n_microbatches


def build_pipeline(
    parts: list[nn.Module],
    stage_ids: list[int],
    num_stages: int,
    n_microbatches: int,
    dims: ParallelDims,
    schedule_name: str,
    device: torch.device,
    loss_fn: LossFn,
    eval_loss_fn: LossFn,
    apply_forward_context: Callable[[nn.Module], None],
    fsdp_reduce: str = "per_step",
) -> Pipeline:
    """Wrap this rank's parallelized stages (job.build_model_parts) in a schedule, each stage's
    forward (only) in the precision plan's forward context: the schedule interleaves forward and
    backward, so a context around `schedule.step` would also cover backward.

    Args:
        parts: this rank's stage modules, parallelized, in `stage_ids` order.
        stage_ids: the global stage index of each part.
        num_stages: stages in the whole pipeline.
        n_microbatches: microbatches each local batch is split into.
        dims: the parallel degrees; the pp mesh and group come from them.
        schedule_name: torch's schedule ("1F1B", "Interleaved1F1B", "GPipe", ...).
        device: this rank's device, where stage inputs are received.
        loss_fn: the loss the last stage computes in training.
        eval_loss_fn: the loss the last stage computes in validation (the eval schedule's).
        apply_forward_context: installs the plan's forward context on one stage module.
        fsdp_reduce: parallelism.pipeline_fsdp_reduce: "per_step" (reduce-scatter once per step) or
            "per_microbatch" (after every microbatch's backward).
    """
    # Imported here: torch.distributed.pipelining imports dynamo (0.7 s of every process's start).
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    from torchtitan_amp.distributed.pipeline_stage import Stage

    pp_mesh = dims.mesh["pp"]
    stages = []
    for sid, part in zip(stage_ids, parts):
        apply_forward_context(part)
        stages.append(
            Stage(
                part,
                sid,
                num_stages,
                device,
                group=pp_mesh.get_group(),
                reduce_per_microbatch=fsdp_reduce == "per_microbatch",
            )
        )
    schedule_cls = get_schedule_class(schedule_name)
    # scale_grads=False: the schedule's own 1/n_microbatches rescales every gradient the stage
    # holds, including those accumulated by earlier gradient-accumulation steps, and would weigh
    # microbatches equally whatever their count of valid labels. The loss function divides by the
    # step's count instead (see Trainer._pipeline_loss).
    stage_arg = stages if issubclass(schedule_cls, PipelineScheduleMulti) else stages[0]
    loss = _ModalLoss(loss_fn, eval_loss_fn)
    schedule = schedule_cls(stage_arg, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    logger.info(
        "pipeline: %s, %d stages, %d microbatches; this rank holds stages %s; FSDP reduces %s",
        schedule_name,
        num_stages,
        n_microbatches,
        stage_ids,
        fsdp_reduce.replace("_", " "),
    )
    return Pipeline(schedule, parts, 0 in stage_ids, num_stages - 1 in stage_ids, n_microbatches, loss)
