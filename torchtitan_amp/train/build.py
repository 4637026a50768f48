"""What a training run is built from, in the order it needs it: `build_training(config, ...)`
checks the config (job.resolve) and builds the data loaders before any process group exists, then
starts the process groups and builds this rank's model parts, optimizer, validator, metrics and
checkpoint manager, resuming from a checkpoint when there is one. The Trainer takes the returned
`TrainingSetup` and runs the loop over it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_amp import memory
from torchtitan_amp.checkpoint import CheckpointManager
from torchtitan_amp.checkpoint.preemption import DeadlineCheck
from torchtitan_amp.checkpoint.train_state import TrainState
from torchtitan_amp.config import JobConfig, to_toml
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.data import build_dataloader
from torchtitan_amp.data.loader import ParallelAwareDataLoader
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.distributed.context_parallel import BatchSharder
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.distributed.pipeline import Pipeline, build_pipeline
from torchtitan_amp.eval import validation
from torchtitan_amp.models.loss import loss_fn
from torchtitan_amp.observability.metrics import MetricsLogger, peak_flops, peak_label, remeasure_cpu_peak
from torchtitan_amp.observability.trackers import build_trackers
from torchtitan_amp.precision import PrecisionPlan, autocast, reducers
from torchtitan_amp.precision import report as report_mod
from torchtitan_amp.precision import scaler as scaler_mod
from torchtitan_amp.precision.lowbit import torchao_kernels
from torchtitan_amp.train import diloco as diloco_mod
from torchtitan_amp.train import fault_tolerance
from torchtitan_amp.train.job import Job, ModelParts, build_model_parts
from torchtitan_amp.train.job import resolve as resolve_job
from torchtitan_amp.train.optim import build_lr_scheduler, build_optimizer

logger = logging.getLogger("torchtitan_amp")

# The schedule's loss on the last pipeline stage: (stage output, labels) -> loss.
StageLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LoopGroups:
    """The process groups the training loop itself talks over; all None on one rank."""

    dp: dist.ProcessGroup | None = None  # the data-parallel ranks: the step's count of valid labels
    pp: dist.ProcessGroup | None = None  # the pipeline stages: gradient norm, the last stage's loss
    loss: dist.ProcessGroup | None = None  # every rank holding a share of the step's tokens (dp x cp)


@dataclass
class Optimization:
    """What updates this rank's trainable parameters."""

    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    reduce_partial_grads: Callable[[list[nn.Parameter]], None]  # the plan's reducer of partial grads


@dataclass
class TrainingSetup:
    """One rank's training run, built and (when a checkpoint exists) resumed: what the Trainer
    runs the loop over (`trainer.run`)."""

    config: JobConfig  # the job's, or under fault tolerance its replica group's (group_config)
    info: process_groups.DistInfo
    job: Job
    groups: LoopGroups
    model_inputs: BatchSharder  # a batch -> what this rank's model sees (document ids, CP chunks)
    scaler: Any  # the plan's loss scaler (a no-op off fp16)
    model_parts: list[nn.Module]
    pipeline: Pipeline | None
    optimization: Optimization
    dataloader: ParallelAwareDataLoader
    validator: validation.Validator | None
    metrics: MetricsLogger
    checkpointer: CheckpointManager
    resumed: TrainState | None  # the step and token count a loaded checkpoint resumes from
    deadline: DeadlineCheck
    estimated_save_s: float  # a save's estimated time before any was measured (pre-emption only)
    ft: fault_tolerance.FaultTolerance | None  # this replica group's torchft Manager (fault_tolerance.enable)
    diloco: diloco_mod.DiLoCo | None  # semi_sync_method = "diloco": the outer state, restored with the rest
    # What the loop asks of the other replica groups (fault tolerance); no-ops for a lone job.
    replicas: fault_tolerance.ReplicaHooks
    sr_rank: int  # the rank that keys block-scaled stochastic rounding, fixed for the run

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def is_logging_rank(self) -> bool:
        return self.info.rank == 0

    @property
    def dims(self) -> ParallelDims:
        return self.job.dims

    @property
    def plan(self) -> PrecisionPlan:
        return self.job.plan

    @property
    def accum(self) -> int:
        """Micro-batches (gradient accumulation steps) per optimizer step."""
        return self.job.accum

    @property
    def model(self) -> nn.Module:
        """The first model part: the whole model off pipeline parallel."""
        return self.model_parts[0]

    @property
    def params(self) -> list[nn.Parameter]:
        return self.optimization.params

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimization.optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.optimization.lr_scheduler


def sr_rank(config: JobConfig, dims: ParallelDims, rank: int) -> int:
    """The rank that keys block-scaled stochastic rounding (block_scaled.seed_step): one per
    (data share, cp rank, tp rank), the ranks that round different values of one step; pipeline
    stages hold different modules, whose streams differ already.

    Args:
        config: the job config (fault tolerance's groups change the data share).
        dims: the parallel degrees.
        rank: this rank's global rank.
    """
    data_rank, _ = fault_tolerance.data_position(config, dims, rank)
    return (data_rank * dims.cp + dims.cp_rank(rank)) * dims.tp + rank % dims.tp


def replica_hooks(
    ft: fault_tolerance.FaultTolerance | None, outer: diloco_mod.DiLoCo | None
) -> fault_tolerance.ReplicaHooks:
    """The loop's dealings with the other replica groups: none without fault tolerance, a quorum
    and a cross-group gradient average per step, or DiLoCo's syncs."""
    if ft is None:
        return fault_tolerance.ReplicaHooks()
    return diloco_mod.DiLoCoReplicas(ft, outer) if outer is not None else fault_tolerance.PerStepReplicas(ft)


def resolve_process_and_job(config: JobConfig) -> tuple[process_groups.DistInfo, Job]:
    """This process's rank and device, and the job: every check that can reject the config,
    before any process group exists."""
    info = process_groups.resolve(config)
    # Before the plan: its probes run CUDA matmuls, which would open a context on cuda:0 on
    # every local rank and fix cuBLAS's workspace before determinism could configure it.
    process_groups.set_device(info)
    process_groups.set_determinism(config.training.deterministic)
    return info, resolve_job(config, info.world_size, info.device.type)


def warn_causal_chat_packing(config: JobConfig, job: Job, rank: int) -> None:
    """One warning (rank 0) when chat data is packed under a plain causal mask: its conversations
    then attend to the ones before them in their window (data/chat.py packs several per window).

    Args:
        config: the job config (model.attn_mask_type, training.dataset).
        job: the resolved job (its validation spec's dataset).
        rank: this process's global rank.
    """
    datasets = {"training.dataset": config.training.dataset}
    if job.validation is not None:
        datasets["validation.dataset"] = job.validation.dataset
    chat = [name for name, dataset in datasets.items() if dataset.startswith("chat:")]
    if chat and config.model.attn_mask_type == "causal" and rank == 0:
        logger.warning(
            "chat data (%s) packs several conversations into a window and model.attn_mask_type = 'causal' "
            "lets each attend to the conversations before it in its window; set model.attn_mask_type = "
            "'block_causal' to train each conversation on its own",
            ", ".join(chat),
        )


def build_loaders(
    config: JobConfig, job: Job, info: process_groups.DistInfo
) -> tuple[ParallelAwareDataLoader, ParallelAwareDataLoader | None]:
    """The training loader and the validation one (None: validation off). Bad data is a
    config-time error too, so they are built before any process group.

    Args:
        config: the job config (its training section: dataset, sequence length, batch, seed).
        job: the resolved job; its tokenizer, validation spec and accumulation steps.
        info: this process's rank and device (torchrun's environment).
    """
    t, dims = config.training, job.dims
    tokenizer = job.tokenizer
    if tokenizer is None:  # only a dry run's job lacks one (dry_run.vocab_size), and it builds no loader
        raise RuntimeError("the data loaders need the job's tokenizer; this job was resolved for a dry run")
    warn_causal_chat_packing(config, job, info.rank)
    # Under fault tolerance every replica group reads its own share of the global order.
    dp_rank, dp_degree = fault_tolerance.data_position(config, dims, info.rank)
    loader = build_dataloader(
        t.dataset,
        tokenizer,
        t.seq_len,
        t.local_batch_size,
        dp_rank,
        dp_degree,
        t.seed,
        num_workers=t.dataloader_num_workers,
        pin_memory=info.device.type == "cuda",
        samples_per_step=t.local_batch_size * dp_degree * job.accum,
    )
    spec = job.validation
    val_loader = validation.build_loader(spec, tokenizer, dp_rank, dp_degree, t.seed) if spec is not None else None
    return loader, val_loader


def build_groups(info: process_groups.DistInfo, job: Job) -> LoopGroups:
    """The device mesh, and the groups the loop itself talks over (data, loss, pipeline)."""
    if info.world_size == 1:
        return LoopGroups()
    dims = job.dims
    mesh = dims.build_mesh(info.device.type)
    assert dims.get_mesh("dp").get_local_rank() == dims.dp_rank(info.rank)
    assert mesh["cp"].get_local_rank() == dims.cp_rank(info.rank)
    # Every rank holding a share of the step's tokens: cp ranks hold parts of one window.
    return LoopGroups(
        dp=dims.get_mesh("dp").get_group(),
        pp=mesh["pp"].get_group() if dims.pp_enabled else None,
        loss=dims.get_mesh("loss").get_group(),
    )


def build_model(
    config: JobConfig,
    job: Job,
    device: torch.device,
    is_logging_rank: bool,
    pipeline_loss: StageLoss,
    pipeline_eval_loss: StageLoss,
) -> tuple[ModelParts, Pipeline | None]:
    """This rank's model parts (job.build_model_parts); under PP also the schedule over them.

    Args:
        config: the job config (its pipeline schedule and reduction).
        job: the resolved job: layout, plan, the stages this rank holds.
        device: this rank's device.
        is_logging_rank: True on the rank that logs the model summary (rank 0).
        pipeline_loss: the loss the last pipeline stage computes in training (used only under PP).
        pipeline_eval_loss: the loss the last pipeline stage computes in validation (only under PP).
    """
    dims, plan = job.dims, job.plan
    pp_rank = dims.mesh["pp"].get_local_rank() if dims.pp_enabled else 0
    built = build_model_parts(job, device, job.stage_ids(pp_rank))
    pipeline = None
    if dims.pp_enabled:
        pipeline = build_pipeline(
            built.parts,
            built.stage_ids,
            job.num_stages,
            job.n_microbatches,
            dims,
            config.parallelism.pipeline_parallel_schedule,
            device,
            pipeline_loss,
            pipeline_eval_loss,
            partial(autocast.apply_forward_context, plan),
            config.parallelism.pipeline_fsdp_reduce,
        )
    if is_logging_rank:
        logger.info(
            "model %s: %s parameters, %.3g FLOPs/token, %d-step grad accumulation",
            config.model.flavor,
            f"{built.num_params:,}",
            built.flops_per_token,
            job.accum,
        )
    return built, pipeline


def build_optimization(config: JobConfig, job: Job, device: torch.device, model_parts: list[nn.Module]) -> Optimization:
    """The optimizer (its state dtype and rounding from the plan), the LR schedule and the plan's
    reducer of the gradients DTensor leaves partial, over the parts' trainable parameters.

    Args:
        config: the job config: optimizer, LR schedule and step count.
        job: the resolved job: the precision plan and layout.
        device: this rank's device (the fused kernel's).
        model_parts: this rank's parallelized model parts.
    """
    plan = job.plan
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    optimizer = build_optimizer(
        params,
        config.optimizer,
        device,
        state_dtype=plan.optimizer_state_dtype if plan.mixed_state_optimizer else None,
        stochastic_rounding=plan.stochastic_rounding,
        seed=config.training.seed,
        fused_ok=plan.fused_optimizer_ok,
    )
    reduce_partial_grads = reducers.partial_grad_reducer(plan, model_parts)
    lr_scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    return Optimization(params, optimizer, lr_scheduler, reduce_partial_grads)


def memory_facts(job: Job, world_size: int) -> dict[str, object]:
    """This rank's gradient collectives per step and the bytes per parameter, from the memory
    model (the dry run's numbers, which tests check against real traffic)."""
    coords = job.dims.coordinates(world_size)
    prec = job.precision
    return {
        "gradient_collectives": memory.grad_comm(
            job.model_dims, prec, job.layout, pp_rank=coords["pp"], tp_rank=coords["tp"]
        ),
        "bytes_per_param": prec.bytes_per_param(),
    }


def build_metrics(
    config: JobConfig,
    job: Job,
    device: torch.device,
    is_logging_rank: bool,
    flops_per_token: float,
    precision_report: dict[str, object],
) -> MetricsLogger:
    """The metrics logger and its trackers, which get the job config and the precision report.

    Args:
        config: the job config: metrics and tracker sections, the dump folder.
        job: the resolved job: tokens per step and the precision plan.
        device: this rank's device, whose peak FLOP/s MFU is measured against.
        is_logging_rank: True on the rank that logs and writes metrics (rank 0).
        flops_per_token: the model's training FLOPs per token.
        precision_report: the precision plan's report (report.log_and_write_report), for trackers.
    """
    dims, dtypes = job.dims, job.plan.compute_dtypes
    metrics = MetricsLogger(
        config.job.dump_folder,
        log_freq=config.metrics.log_freq,
        enable_tensorboard=False,
        trackers=build_trackers(config) if is_logging_rank else (),
        is_logging_rank=is_logging_rank,
        flops_per_token=flops_per_token,
        peak_flops=peak_flops(device, dtypes),
        device=device,
        num_ranks_for_mfu=dims.tp * dims.pp * dims.cp,
        peak_label=peak_label(device, dtypes),
        remeasure_peak=partial(remeasure_cpu_peak, dtypes) if device.type == "cpu" else None,
    )
    metrics.describe_run(
        {**config.to_dict(), "precision_report": precision_report},
        [Path(config.job.dump_folder) / "precision_report.json"],
    )
    if is_logging_rank:
        logger.info("mfu is relative to %s", metrics.describe_peak())
    return metrics


def start_deadline(
    config: JobConfig, checkpointer: CheckpointManager, is_logging_rank: bool
) -> tuple[DeadlineCheck, float]:
    """The pre-emption deadline check and, when a warning is configured, a save's estimated time in
    seconds (a probe write; 0 otherwise), so that a job that cannot save in time is told before
    its first step.

    Args:
        config: the job config: its checkpoint section's deadline and warning.
        checkpointer: the run's checkpoint manager, which the probe write goes through.
        is_logging_rank: True on the rank that logs the warning (rank 0).
    """
    deadline = DeadlineCheck(config.checkpoint.preemption_warning_s if checkpointer.enabled else 0)
    if not deadline.warning_s:
        return deadline, 0.0
    size, save_s = checkpointer.estimate_save_s()
    if is_logging_rank:
        logger.info(
            "pre-emption: %d s warning; a save writes %.2f GiB on this rank, estimated %.1f s on the slowest rank",
            deadline.warning_s,
            size / 2**30,
            save_s,
        )
    return deadline, save_s


def build_training(config: JobConfig, *, pipeline_loss: StageLoss, pipeline_eval_loss: StageLoss) -> TrainingSetup:
    """Everything one rank trains with, in order: the config checks and data loaders before any
    process group, then the process groups, model parts, validator, optimizer, precision report,
    metrics and checkpoint manager, loading the checkpoint to resume from when there is one.

    Args:
        config: the job config; under fault tolerance replaced by the replica group's
            (fault_tolerance.group_config: its own output folder).
        pipeline_loss: the loss the pipeline schedule computes on the last stage in training (used
            only under PP).
        pipeline_eval_loss: the loss the pipeline schedule computes on the last stage in validation
            (used only under PP).
    """
    config = fault_tolerance.group_config(config)
    info, job = resolve_process_and_job(config)
    dataloader, val_loader = build_loaders(config, job, info)
    process_groups.init(info, config.comm.init_timeout_seconds)
    if job.plan.measured_here and (
        problem := job.plan.disagreement(process_groups.values_by_rank("precision", job.plan.what_trains))
    ):
        raise PrecisionError(problem)
    device, is_logging_rank = info.device, info.rank == 0
    if is_logging_rank and config.job.print_config:
        logger.info("resolved config:\n%s", to_toml(config))
    groups = build_groups(info, job)
    model_inputs = BatchSharder(job.mask_inputs, job.dims.cp, job.dims.cp_rank(info.rank))
    scaler = scaler_mod.build_scaler(job.plan)
    built, pipeline = build_model(config, job, device, is_logging_rank, pipeline_loss, pipeline_eval_loss)
    ft = fault_tolerance.build(config, job.plan, device.type)
    if ft is not None and not job.plan.sync_steps:  # DiLoCo: no per-step cross-group all-reduce
        ft.attach(built.parts)
    parts = built.parts
    validator = _build_validator(
        config, job, val_loader, parts, pipeline, model_inputs, groups, device, is_logging_rank
    )
    optimization = build_optimization(config, job, device, parts)
    # Before the checkpoint manager: a checkpoint holds DiLoCo's state (its "diloco" part).
    outer = diloco_mod.build(config, ft, parts, optimization.params, job.plan)
    report = report_mod.log_and_write_report(
        job.plan, nn.ModuleList(parts), config.job.dump_folder, is_logging_rank, memory_facts(job, info.world_size)
    )
    metrics = build_metrics(config, job, device, is_logging_rank, built.flops_per_token, report)
    checkpointer = CheckpointManager(
        config,
        model=parts,
        optimizer=optimization.optimizer,
        lr_scheduler=optimization.lr_scheduler,
        scaler=scaler,
        dataloader=dataloader,
        model_args=job.model_args,
        device=device,
        pp_degree=job.dims.pp,
        validator=validator,
        replica=ft.replica_group() if ft is not None else None,
        outer_state=outer,
    )
    resumed = checkpointer.load()
    if outer is not None:
        outer.after_load()
    deadline, estimated_save_s = start_deadline(config, checkpointer, is_logging_rank)
    # torchao's NVFP4Linear: its stochastic-rounding keys per rank (the emulation's: train_step)
    rounding_rank = sr_rank(config, job.dims, info.rank)
    torchao_kernels.materialized(parts, rounding_rank)
    return TrainingSetup(
        config,
        info,
        job,
        groups,
        model_inputs,
        scaler,
        parts,
        pipeline,
        optimization,
        dataloader,
        validator,
        metrics,
        checkpointer,
        resumed,
        deadline,
        estimated_save_s,
        ft,
        outer,
        replica_hooks(ft, outer),
        rounding_rank,
    )


def _build_validator(
    config: JobConfig,
    job: Job,
    val_loader: ParallelAwareDataLoader | None,
    parts: list[nn.Module],
    pipeline: Pipeline | None,
    model_inputs: BatchSharder,
    groups: LoopGroups,
    device: torch.device,
    is_logging_rank: bool,
) -> validation.Validator | None:
    """The validator over this rank's model parts (None: validation off)."""
    spec = job.validation
    if spec is None:
        return None
    return validation.Validator(
        spec,
        val_loader,
        config=config,
        plan=job.plan,
        dims=job.dims,
        model_parts=parts,
        pipeline=pipeline,
        loss_fn=loss_fn,
        model_inputs=model_inputs,
        device=device,
        loss_group=groups.loss,
        pp_group=groups.pp,
        is_logging_rank=is_logging_rank,
    )
