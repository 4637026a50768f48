"""The training loop: train steps (micro-batches, loss, backward, gradient clipping, optimizer
step) and the cadence around them (logging, validation, checkpoints, stopping), over what
train/build.py built for this rank."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan_amp.checkpoint.preemption import maybe_inject_fault
from torchtitan_amp.config import ConfigError, JobConfig, load_config
from torchtitan_amp.core.errors import NonFiniteError
from torchtitan_amp.data.loader import to_device
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.distributed.tensor_parallel import parallel_context
from torchtitan_amp.models.loss import count_valid_labels, label_weight, loss_fn
from torchtitan_amp.observability import profiling
from torchtitan_amp.precision import autocast, block_scaled
from torchtitan_amp.precision.lowbit import float8, torchao_kernels
from torchtitan_amp.train.build import build_training
from torchtitan_amp.train.fault_tolerance import TrainingState, data_position, group_config, init_optimizer_state

if TYPE_CHECKING:
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.precision.audit import AuditResult

logger = logging.getLogger("torchtitan_amp")


def _grad_groups(params: list[nn.Parameter]) -> list[list[torch.Tensor]]:
    """Gradients grouped so that each group is all plain tensors or all DTensors of one mesh:
    foreach kernels refuse a mixture of the two, or DTensors of different meshes."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    return list(groups.values())


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                    *, device: torch.device) -> torch.Tensor:
    """Global grad norm (over every shard and pipeline stage), clipping when max_norm > 0. `device`
    is the rank's (the trainer's): a stage with nothing trained has no parameter to take it from."""
    groups = _grad_groups(params)
    squares = []
    for grads in groups:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    # A stage whose parameters got no gradient (or that trains none) still joins the pipeline
    # all-reduce, on the rank's device (nccl takes no CPU tensor).
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        # Stages hold disjoint parameters: add squared norms across them.
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def sr_rank(config: JobConfig, dims: ParallelDims, rank: int) -> int:
    """The rank that keys block-scaled stochastic rounding (block_scaled.seed_step): one per
    (data share, cp rank, tp rank), the ranks that round different values of one step; pipeline
    stages hold different modules, whose streams differ already."""
    data_rank, _ = data_position(config, dims, rank)
    return (data_rank * dims.cp + dims.cp_rank(rank)) * dims.tp + rank % dims.tp


class Trainer:
    """Runs the training loop over what `build.build_training` built for this rank: the step
    (micro-batches, loss, backward, clipping, optimizer), and when to log, validate, save and stop."""

    def __init__(self, config: JobConfig) -> None:
        config = group_config(config)  # a fault-tolerant replica group's own output folder
        self.config = config
        setup = build_training(config, pipeline_loss=self._pipeline_loss,
                               pipeline_eval_loss=self._pipeline_eval_loss)
        self.info, self.job, self.device = setup.info, setup.job, setup.info.device
        self.dims, self.accum, self.plan = self.job.dims, self.job.accum, self.job.plan
        self.model_args = self.job.model_args
        self.is_logging_rank = self.info.rank == 0
        self.dp_group, self.pp_group, self.loss_group = setup.groups.dp, setup.groups.pp, setup.groups.loss
        self.model_inputs, self.scaler, self.pipeline = setup.model_inputs, setup.scaler, setup.pipeline
        self.model_parts = setup.model_parts
        self.model = self.model_parts[0]
        # torchao's NVFP4Linear: its stochastic-rounding keys per rank (the emulation's: train_step)
        self.sr_rank = sr_rank(config, self.dims, self.info.rank)  # fixed for the run
        torchao_kernels.materialized(self.model_parts, self.sr_rank)
        opt = setup.optimization
        self.params, self.optimizer, self.lr_scheduler = opt.params, opt.optimizer, opt.lr_scheduler
        self.reduce_partial_grads = opt.reduce_partial_grads
        self.dataloader, self.validator = setup.dataloader, setup.validator
        self.metrics, self.checkpointer = setup.metrics, setup.checkpointer
        self._label_weight = torch.ones((), device=self.device)  # set per step (forward_backward)
        self.step = setup.resumed.step if setup.resumed is not None else 0
        self.tokens_seen = setup.resumed.tokens_seen if setup.resumed is not None else 0
        self.family_metrics: dict[str, torch.Tensor] = {}  # the family's per-step numbers (MoE load)
        self.nonfinite_skipped = 0
        self.data_time_s = 0.0
        self.deadline, self.estimated_save_s = setup.deadline, setup.estimated_save_s
        if self.deadline.warning_s:
            self._check_deadline(0.0, "start-up estimate:")
        self.ft = setup.ft
        if self.ft is not None:
            init_optimizer_state(self.optimizer, self.params)
            self.ft.register(TrainingState(self.model_parts, self.optimizer, self.lr_scheduler, self.dataloader, self))
        # semi_sync_method = "diloco": groups train alone and sync every sync_steps (else None).
        self.diloco = setup.diloco
        self.ft_every_step = self.ft is not None and self.diloco is None

    def _check_deadline(self, step_s: float, basis: str) -> None:
        """Warn (once per basis) when a step plus the last measured save, or the estimate before
        any save, would not fit in the pre-emption warning."""
        save_s = self.checkpointer.last_save_s or self.estimated_save_s
        problem = self.deadline.problem(step_s, save_s, basis)
        if problem and self.is_logging_rank:
            logger.warning(problem)

    # -----------------------------------------------------------------------------------------

    def _pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss on the last stage, called by the schedule per microbatch (scaled for fp16): the sum
        over its valid labels times the step's label weight, so that the microbatches of all
        accumulation steps and ranks make the step's mean."""
        loss = loss_fn(autocast.cast_output(self.plan, output), labels, reduction="sum") * self._label_weight
        return self.scaler.scale(loss)

    def _pipeline_eval_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss on the last stage during evaluation: the sum over the microbatch's valid labels
        (validation divides by their count)."""
        return loss_fn(autocast.cast_output(self.plan, output), labels, reduction="sum")

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor,
                         weight: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch (a loader batch: the whole windows). `weight`: each valid label's weight,
        `label_weight` of the step's count (None: of this micro-batch's over the data-parallel
        ranks, as a one-micro-batch step). Returns this rank's loss (0 on pipeline stages without
        the loss): its cross-entropy sum times the weight, so that the mean of the loss ranks'
        losses (and the gradient wrappers' mean of their gradients) is the step's mean."""
        self._label_weight = self._step_label_weight([labels]) if weight is None else weight
        inputs, labels, extra = self.model_inputs(inputs, labels)
        if self.pipeline is not None:
            self._set_loss_factor(self.accum * self.pipeline.n_microbatches)
            with parallel_context(self.dims, self.config):
                losses = self.pipeline.step(inputs, labels, **extra)
            if not losses:
                return torch.zeros((), device=self.device)
            # The schedule saw scaled, pre-divided fp32 losses (Pipeline.step detached them): their
            # sum is this step's share of the mean.
            return torch.stack(losses).sum() / self.scaler.get_scale()
        # Before the forward: the aux loss captures its factor there, and the factor must be the
        # one this micro-batch's loss is scaled by (the scale changes only between steps).
        self._set_loss_factor(self.accum)
        with parallel_context(self.dims, self.config), autocast.forward_context(self.plan):
            logits = autocast.cast_output(self.plan, self.model(inputs, **extra))
            loss = loss_fn(logits, labels, reduction="sum") * self._label_weight
        with parallel_context(self.dims, self.config), autocast.backward_context(self.plan):
            self.scaler.scale(loss).backward()
        loss = loss.detach()
        # Under loss parallel the loss is a replicated DTensor.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _step_label_weight(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """`label_weight` of the valid labels in `labels` (loader batches: whole windows) over
        every data-parallel rank. The cp ranks of a data-parallel rank hold the same windows, so
        the dp group's sum is the step's count; the gradient mean runs over dp x cp (the loss
        group, which is also FSDP's, HSDP's or DDP's group and EP's divide factor)."""
        return self._label_weights(labels)[0]

    def _label_weights(self, labels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(each valid label's weight, the factor that turns this group's losses into its own
        mean, or None). Under per-step fault tolerance torchft then averages the replica groups'
        gradients: the count is the quorum's (summed across the groups) and the weight is
        multiplied by the groups, so that the average is the mean over every valid label of the
        quorum, not a mean of the groups' means (which differ whenever the groups hold different
        numbers of valid labels). Each group still logs its own mean loss (the factor)."""
        grad_mean_size = dist.get_world_size(self.loss_group) if self.loss_group is not None else 1
        count = count_valid_labels(labels, self.dp_group)
        if not self.ft_every_step:
            return label_weight(count, grad_mean_size), None
        total = count.clone()
        self.ft.sum_across_groups(total)
        weight = label_weight(total, grad_mean_size * self.ft.participants)
        return weight, label_weight(count, grad_mean_size) / weight

    def _set_loss_factor(self, divisor: int) -> None:
        """Losses the model adds itself (MoE's auxiliary loss) get the trainer's loss factor."""
        if self.job.family.set_loss_factor is not None:
            self.job.family.set_loss_factor(self.model_parts, self.scaler.get_scale() / divisor)

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step over `accum` micro-batches from `batches`. Returns this rank's loss
        (its share of the step's mean), the global gradient norm, and whether the optimizer stepped
        (not on a skipped non-finite or fp16-overflow step)."""
        autocast.check_no_user_autocast(self.plan)
        if self.plan.block_scaled is not None and self.plan.block_scaled.stochastic_rounding:
            block_scaled.seed_step(self.model_parts, self.step, self.sr_rank)
        self.optimizer.zero_grad(set_to_none=True)
        # fp32 accumulator: a low-precision running sum stalls once it is large enough.
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        micro_batches = self._next_micro_batches(batches)
        # Every micro-batch's loss is divided by the step's count of valid labels, known before the
        # first backward: the micro-batches are fetched first (as torchtitan does).
        weight, group_loss_factor = self._label_weights([labels for _, labels in micro_batches])
        for micro, (inputs, labels) in enumerate(micro_batches):
            self._set_gradient_sync(micro == self.accum - 1)
            loss_sum += self.forward_backward(inputs, labels, weight)
            self.metrics.record_tokens(inputs.numel())
        if group_loss_factor is not None:
            loss_sum *= group_loss_factor
        self.reduce_partial_grads(self.params)
        if self.ft_every_step:
            self.ft.backward_done()
            self.ft.allreduce_grads(self.params)
        if self.job.family.after_backward is not None:
            cross_group = self.ft.sum_across_groups if self.ft_every_step else None
            self.family_metrics = self.job.family.after_backward(self.model_parts, self.loss_group, self.pp_group,
                                                                 cross_group=cross_group)
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm_(self.params, self.config.training.max_norm, self.pp_group, device=self.device)
        if self.ft_every_step and not self.ft.should_commit():
            # A replica group failed during the cross-group all-reduce: the gradients are partial.
            return loss_sum, grad_norm, False
        # The one device->host read of a step, kept on purpose: skipping exactly (weights, AdamW
        # moments and step counts, LR schedule untouched; NonFiniteError raised at this step)
        # needs the flag before the optimizer step is launched. A skip on the device would need
        # found_inf support in every optimizer kernel (torch's fused AdamW only, not foreach or
        # AdamWMixedState) and a deferred LR step and counter. The read waits for backward + clip
        # only; the optimizer kernels then cover the host's preparation of the next step, which
        # no longer syncs itself (pinned non-blocking input copies, the stop poll on a gloo group).
        if not self.scaler.enabled and not torch.isfinite(grad_norm):
            # The norm is global, so every rank takes the same branch. Under fp16 the scaler
            # owns this case (skip + back off), so it never gets here.
            if not self.config.training.skip_nonfinite_steps:
                raise NonFiniteError(
                    f"step {self.step}: gradient norm is {float(grad_norm)} (loss on this rank "
                    f"{float(loss_sum)}); try a lower optimizer.lr or more lr_scheduler.warmup_steps, "
                    f"training.max_norm > 0, bfloat16 instead of float16, or "
                    f"training.skip_nonfinite_steps = true to skip such steps")
            self.nonfinite_skipped += 1
            logger.warning("step %d: non-finite gradient norm %s, step skipped (%d so far)",
                           self.step, float(grad_norm), self.nonfinite_skipped)
            return loss_sum, grad_norm, False
        stepped = self.scaler.step(self.optimizer)
        if stepped:
            # A skipped fp16 step must not advance the schedule.
            self.lr_scheduler.step()
            float8.after_optimizer_step(self.model_parts, self.plan.fp8_all_gather)
            if self.job.family.after_step is not None:
                self.job.family.after_step(self.model_parts)
        return loss_sum, grad_norm, stepped

    def _set_gradient_sync(self, sync: bool) -> None:
        """DDP, and FSDP under per-step fault tolerance, accumulate the micro-batches' gradients
        locally and reduce once, in the last micro-batch's backward (`sync`): the all-reduce
        across DDP's ranks, or across the replica groups (torchft's, in FSDP's all-reduce hook:
        its reduce-scatter runs once too, over unsharded gradients accumulated in the reduce
        dtype). Plain FSDP reduce-scatters every micro-batch (sharded gradients accumulate)."""
        for part in self.model_parts:
            if self.dims.ddp_enabled or (self.ft_every_step and isinstance(part, FSDPModule)):
                part.set_requires_gradient_sync(sync)

    def _next_micro_batches(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's `accum` loader batches, on the device (waiting for them is data time)."""
        out = []
        for _ in range(self.accum):
            data_start = time.perf_counter()
            inputs, labels = next(batches)
            self.data_time_s += time.perf_counter() - data_start
            out.append((to_device(inputs, self.device), to_device(labels, self.device)))
        return out

    def train(self) -> None:
        """Steps up to training.steps (or a stop signal), validating, logging and saving at their
        intervals; with checkpoint.create_seed_checkpoint, only the step-0 checkpoint."""
        t = self.config.training
        if self.config.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            self.metrics.close()
            return
        batches = self._new_batches()
        if self.diloco is not None and self.diloco.sync(self):
            batches = self._new_batches()  # joined by healing: the data position is the live group's
        tokens_per_step = t.local_batch_size * t.seq_len * self.accum * self.dims.dp_degree
        if self.is_logging_rank:
            logger.info("training %d steps on %s (%s), world size %d", t.steps, self.device,
                        self.info.backend, self.info.world_size)
        first_step, checkpoints, ran = self.step, 0, 0
        self.metrics.start_run(first_step, t.steps)
        with profiling.maybe_profile(self.config, self.info.rank, self.step) as prof, \
                profiling.maybe_memory_snapshot(self.config, self.info.rank):
            while self.step < t.steps:
                self.step += 1
                if t.gc_freq and self.step % t.gc_freq == 0:
                    gc.collect(1)
                step_start = time.perf_counter()
                if self.ft_every_step and self.ft.start_step():
                    batches = self._new_batches()  # healed: the data position is the live group's
                lr = self.lr_scheduler.get_last_lr()[0]
                loss, grad_norm, _ = self.train_step(batches)
                if self.ft_every_step and self.ft.last_discarded:
                    self.step -= 1  # the step is retried on the next batches by the groups still alive
                    if self._stop_after_discarded_step():
                        break
                    continue
                step_s = time.perf_counter() - step_start
                self.tokens_seen += tokens_per_step
                if self.diloco is not None and self.diloco.due(self.step, t.steps) and self.diloco.sync(self):
                    batches = self._new_batches()  # healed: step, counters and data are the live group's
                ran += 1
                if ran == 1:
                    # Start-up (compile, first all-gathers) may be slow; steady state must not hang.
                    # Counted in steps this process ran: a heal sets self.step to the live group's.
                    process_groups.set_timeouts(self.config.comm.timeout_seconds, self.dims)
                maybe_inject_fault(self.config, self.step, self.info.rank)
                val = self._maybe_validate()
                if self.metrics.should_log(self.step) or self.step == t.steps or val:
                    self._log(loss, grad_norm, lr, val)
                stop = self.checkpointer.should_stop()  # SIGTERM/SIGUSR1 on any rank: save and exit
                saved_before = self.checkpointer.last_saved_step
                self.checkpointer.maybe_save(self.step, self.tokens_seen, last=self.step == t.steps, force=stop)
                checkpoints += self.checkpointer.last_saved_step != saved_before
                if self.deadline.warning_s and self.step > first_step + 1:  # the first step warms up
                    self._check_deadline(step_s, "measured" if self.checkpointer.last_save_s else
                                         "measured step, estimated save:")
                if prof is not None:
                    prof.step()
                if stop:
                    break
        self.checkpointer.close()
        if self.ft is not None:
            self.ft.shutdown()
        self.metrics.log_summary(self.step, self.tokens_seen, checkpoints)
        self.metrics.close()

    def _stop_after_discarded_step(self) -> bool:
        """After a discarded fault-tolerant step: whether a stop signal reached any rank (every
        rank of the group discarded it, so every rank polls), and if so the forced save of the last
        committed step. A group that keeps failing to commit must still obey pre-emption."""
        if not self.checkpointer.should_stop():
            return False
        self.checkpointer.maybe_save(self.step, self.tokens_seen, force=True)
        return True

    def _new_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """An iterator over the training loader, from where it stands."""
        # Creating the iterator draws a seed from the global RNG; fork so that a resumed run's RNG
        # (restored from the checkpoint) matches the uninterrupted run's.
        with torch.random.fork_rng(devices=[]):
            return iter(self.dataloader)

    def audited_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The step the audit records: a train step as the loop runs it, so under fault tolerance
        with its quorum first (torchft's all-reduce needs one: per-step averaging), or followed by
        a DiLoCo sync (the pseudo-gradient all-reduce). Each replica group runs its audit, and the
        quorum waits for fault_tolerance.min_replica_size of them, as training does."""
        if self.ft_every_step:
            self.ft.start_step()
        self.train_step(batches)
        if self.diloco is not None:
            self.diloco.sync(self)

    def audit(self) -> "AuditResult":
        """One train step checked against the precision plan (`mixed_precision.audit`, by
        precision/audit.py), instead of training."""
        from torchtitan_amp.precision import audit

        result = audit.audit_step(self, self._new_batches(), self.config.job.dump_folder, self.is_logging_rank)
        self.metrics.close()
        if self.ft is not None:
            self.ft.shutdown()
        return result

    def _maybe_validate(self) -> dict[str, float]:
        """The validation results when an evaluation is due at this step, else {}."""
        if self.validator is None or not self.validator.spec.due(self.step, self.config.training.steps):
            return {}
        result = self.validator.run()
        self.metrics.exclude_time(result["val_time_s"])
        if self.validator.samples:
            self.metrics.log_samples(self.step, self.validator.samples)
        return result

    def evaluate(self) -> dict[str, float]:
        """One evaluation of the current (loaded) weights, outside training (tools/evaluate.py)."""
        if self.validator is None:
            raise ConfigError("evaluation needs validation.enable = true")
        return self.validator.run()

    def _log(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
             val: dict[str, float] | None = None) -> None:
        """One metrics row: the step's mean loss over the loss ranks (NonFiniteError when it is not
        finite and nothing may skip it), the gradient norm, LR and the run's counters."""
        extra = {"tokens_seen": float(self.tokens_seen), "epoch": float(self.dataloader.epoch),
                 "step_time_s": self.metrics.step_time_s(self.step),
                 "data_time_s": self.data_time_s, **{k: float(v) for k, v in self.family_metrics.items()},
                 **(val or {})}
        self.data_time_s = 0.0
        if self.nonfinite_skipped:
            extra["nonfinite_skipped"] = float(self.nonfinite_skipped)
        if self.ft is not None:
            extra.update(self.ft.metrics())
        if self.diloco is not None:
            extra.update(self.diloco.metrics())
        if self.scaler.enabled:
            extra.update(loss_scale=self.scaler.get_scale(), skipped_steps=float(self.scaler.skipped_steps))
        if self.pp_group is not None:
            # Only the last stage computed the loss; the others hold 0.
            loss = loss.clone()
            dist.all_reduce(loss, group=self.pp_group)
        # Each rank's loss is its share of the step's label sum times the loss group's size
        # (label_weight): their mean over the data- and context-parallel ranks is the step's mean.
        mean_loss = process_groups.mean_across(loss, self.loss_group)
        if not math.isfinite(mean_loss) and not self.scaler.enabled and not self.config.training.skip_nonfinite_steps:
            raise NonFiniteError(f"step {self.step}: loss is {mean_loss}; try a lower optimizer.lr, "
                                 f"training.max_norm > 0, or training.skip_nonfinite_steps = true")
        self.metrics.log(self.step, mean_loss, float(grad_norm), lr, extra)


def train_in_turn(runs: list[tuple[Path, list[str]]],
                  inspect: Callable[[Trainer], dict] | None = None) -> Iterator[tuple[int, float]]:
    """Several jobs in one launch (tests, numerics_matrix), process start-up paid once: for each
    (dump folder, overrides) in turn, a fresh Trainer and `train()`, exactly what train.py does. A run that raises writes FOLDER/error_rank{R}.txt and re-raises, so later
    runs do not start. With `inspect`, every rank writes FOLDER/rank{R}.json = inspect(trainer)
    after training. Yields (index of the run, seconds it took) once every rank has finished it."""
    rank = os.environ.get("RANK", "0")
    for index, (folder, args) in enumerate(runs):
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            trainer = Trainer(load_config([*args, "--job.dump_folder", str(folder)]))
            trainer.train()
            if inspect is not None:
                (folder / f"rank{rank}.json").write_text(json.dumps(inspect(trainer)))
        except BaseException:
            (folder / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            raise
        del trainer
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
        yield index, time.perf_counter() - start
