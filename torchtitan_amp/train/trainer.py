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
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_amp.checkpoint.preemption import maybe_inject_fault
from torchtitan_amp.config import ConfigError, JobConfig, load_config
from torchtitan_amp.core.errors import NonFiniteError
from torchtitan_amp.data.loader import to_device
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.distributed.grad_norm import clip_grad_norm_
from torchtitan_amp.distributed.tensor_parallel import parallel_context
from torchtitan_amp.models.loss import count_valid_labels, loss_fn
from torchtitan_amp.observability import profiling
from torchtitan_amp.precision import autocast, block_scaled
from torchtitan_amp.precision.lowbit import float8
from torchtitan_amp.train.build import build_training

if TYPE_CHECKING:
    from torch.distributed._composable.replicate import DDP as ReplicateModule
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_amp.precision.audit import AuditResult

logger = logging.getLogger("torchtitan_amp")


class Trainer:
    """Runs the training loop over what `build.build_training` built for this rank (`run`): the
    step, as a sequence of phases (forward and backward over the micro-batches, after backward,
    unscale and clip, the optimizer step, after the optimizer step), and when to log, validate,
    save and stop. What fault tolerance adds goes through `run.replicas` (train/fault_tolerance.py)."""

    def __init__(self, config: JobConfig) -> None:
        self.run = build_training(
            config, pipeline_loss=self._pipeline_loss, pipeline_eval_loss=self._pipeline_eval_loss
        )
        self.config = self.run.config  # a fault-tolerant replica group's has its own output folder
        self._label_weight = torch.ones((), device=self.run.device)  # set per step (forward_backward)
        resumed = self.run.resumed
        self.step = resumed.step if resumed is not None else 0
        self.tokens_seen = resumed.tokens_seen if resumed is not None else 0
        self.family_metrics: dict[str, torch.Tensor] = {}  # the family's per-step numbers (MoE load)
        self.extra_losses: dict[str, torch.Tensor] = {}  # the step's losses a model adds (logged apart)
        self.step_extra_losses: dict[str, torch.Tensor] = {}  # the last step's, this rank's share
        self._microbatch_extras: list[dict[str, torch.Tensor]] = []  # under PP: each loss call's
        self.nonfinite_skipped = 0
        self.data_time_s = 0.0
        if self.run.deadline.warning_s:
            self._check_deadline(0.0, "start-up estimate:")
        self.run.replicas.register(self)

    def _check_deadline(self, step_s: float, basis: str) -> None:
        """Warn (once per basis) when a step plus the last measured save, or the estimate before
        any save, would not fit in the pre-emption warning."""
        save_s = self.run.checkpointer.last_save_s or self.run.estimated_save_s
        problem = self.run.deadline.problem(step_s, save_s, basis)
        if problem and self.run.is_logging_rank:
            logger.warning(problem)

    # -----------------------------------------------------------------------------------------

    def _pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss on the last stage, called by the schedule per microbatch (scaled for fp16): the sum
        over its valid labels times the step's label weight, so that the microbatches of all
        accumulation steps and ranks make the step's mean."""
        loss = loss_fn(autocast.cast_output(self.run.plan, output), labels, reduction="sum") * self._label_weight
        if self.run.job.family.takes_labels(self.run.job.model_args):
            # The losses the last stage's forward added (multi-token prediction), weighted as the
            # main one: trained on through the returned loss, whose value stays the main loss's
            # (x - x.detach() is 0 with x's gradient), and logged apart.
            last = next(part for part in self.run.model_parts if cast(Any, part).output is not None)
            extras = {name: value * self._label_weight for name, value in cast(Any, last).pop_extra_losses().items()}
            loss = loss + sum(value - value.detach() for value in extras.values())
            self._microbatch_extras.append(extras)
        return self.run.scaler.scale(loss)

    def _pipeline_eval_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss on the last stage during evaluation: the sum over the microbatch's valid labels
        (validation divides by their count)."""
        return loss_fn(autocast.cast_output(self.run.plan, output), labels, reduction="sum")

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One micro-batch (a loader batch: the whole windows). Returns this rank's loss (0 on
        pipeline stages without the loss): its cross-entropy sum times the weight, so that the mean of
        the loss ranks' losses (and the gradient wrappers' mean of their gradients) is the step's mean.

        Args:
            inputs: [B, S] token ids.
            labels: [B, S] target ids (the ignore index where not counted).
            weight: each valid label's weight, `label_weight` of the step's count (None: of this
                micro-batch's over the data-parallel ranks, as a one-micro-batch step).
        """
        run = self.run
        self._label_weight = self._step_label_weight([labels]) if weight is None else weight
        inputs, labels, extra = run.model_inputs(inputs, labels)
        if run.pipeline is not None:
            self._set_loss_factor(run.accum * run.pipeline.n_microbatches)
            takes_labels, self._microbatch_extras = run.job.family.takes_labels(run.job.model_args), []
            with parallel_context(run.dims, self.config):
                # Labels as a keyword reach every stage: the last one's forward computes the
                # losses the model adds (_pipeline_loss takes them there).
                losses = run.pipeline.step(inputs, labels, forward_labels=takes_labels, **extra)
            # The microbatches' (the first step's metadata pass called the loss once before them);
            # a stage without the loss holds 0 of each.
            taken = self._microbatch_extras[len(self._microbatch_extras) - len(losses) :]
            for part in run.model_parts if takes_labels and not losses else []:
                taken.append(cast(Any, part).pop_extra_losses())
            for name, value in (item for extras in taken for item in extras.items()):
                self._add_extra_loss(name, value)
            if not losses:
                return torch.zeros((), device=run.device)
            # The schedule saw scaled, pre-divided fp32 losses (Pipeline.step detached them): their
            # sum is this step's share of the mean.
            return torch.stack(losses).sum() / run.scaler.get_scale()
        # Before the forward: the aux loss captures its factor there, and the factor must be the
        # one this micro-batch's loss is scaled by (the scale changes only between steps).
        self._set_loss_factor(run.accum)
        # A model that adds losses of its own from the labels (DeepSeek-V3's multi-token prediction)
        # takes them; each is weighted as the main one, trained on, and logged apart by its name.
        takes_labels = run.job.family.takes_labels(run.job.model_args)
        with parallel_context(run.dims, self.config), autocast.forward_context(run.plan):
            logits = autocast.cast_output(
                run.plan, run.model(inputs, **extra, **({"labels": labels} if takes_labels else {}))
            )
            loss = loss_fn(logits, labels, reduction="sum") * self._label_weight
            extras = cast(Any, run.model).pop_extra_losses() if takes_labels else {}
            extras = {name: value * self._label_weight for name, value in extras.items()}
        with parallel_context(run.dims, self.config), autocast.backward_context(run.plan):
            run.scaler.scale(loss + sum(extras.values()) if extras else loss).backward()
        for name, value in extras.items():
            self._add_extra_loss(name, value)
        loss = loss.detach()
        # Under loss parallel the loss is a replicated DTensor.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _add_extra_loss(self, name: str, value: torch.Tensor) -> None:
        """Add one forward's weighted `name` loss to the step's log (under loss parallel a
        replicated DTensor, as the main loss)."""
        value = value.detach()
        self.extra_losses[name] = self.extra_losses.get(name, 0) + (
            value.full_tensor() if isinstance(value, DTensor) else value
        )

    def _step_label_weight(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """`label_weight` of the valid labels in `labels` (loader batches: whole windows) over
        every data-parallel rank. The cp ranks of a data-parallel rank hold the same windows, so
        the dp group's sum is the step's count; the gradient mean runs over dp x cp (the loss
        group, which is also FSDP's, HSDP's or DDP's group and EP's divide factor)."""
        return self._label_weights(labels)[0]

    def _label_weights(self, labels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(each valid label's weight, the factor that turns this group's losses into its own
        mean, or None): the replica hooks' label_weights of the step's count over the data-parallel
        ranks (under per-step fault tolerance the count is the quorum's)."""
        groups = self.run.groups
        grad_mean_size = dist.get_world_size(groups.loss) if groups.loss is not None else 1
        count = count_valid_labels(labels, groups.dp)
        return self.run.replicas.label_weights(count, grad_mean_size)

    def _set_loss_factor(self, divisor: int) -> None:
        """Losses the model adds itself (MoE's auxiliary loss) get the trainer's loss factor."""
        self.run.job.family.set_loss_factor(self.run.model_parts, self.run.scaler.get_scale() / divisor)

    def train_step(
        self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step over `accum` micro-batches from `batches`, phase by phase. Returns
        this rank's loss (its share of the step's mean), the global gradient norm, and whether the
        optimizer stepped (not on a skipped non-finite or fp16-overflow step, nor on a step another
        replica group failed during)."""
        loss_sum = self.forward_backward_step(batches)
        self.after_backward()
        grad_norm = self.unscale_and_clip()
        if not self.run.replicas.committed() or not self.gradients_finite(loss_sum, grad_norm):
            return loss_sum, grad_norm, False
        stepped = self.run.scaler.step(self.run.optimizer)
        if stepped:  # a skipped fp16 step must not advance the schedule
            self.after_optimizer_step()
        return loss_sum, grad_norm, stepped

    def forward_backward_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Phase 1: gradients zeroed, then forward and backward over the step's micro-batches;
        returns this rank's loss (fp32 sum of the micro-batches' shares)."""
        run = self.run
        autocast.check_no_user_autocast(run.plan)
        if run.plan.block_scaled is not None and run.plan.block_scaled.stochastic_rounding:
            block_scaled.seed_step(run.model_parts, self.step, run.sr_rank)
        run.optimizer.zero_grad(set_to_none=True)
        # fp32 accumulator: a low-precision running sum stalls once it is large enough.
        loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
        micro_batches = self._next_micro_batches(batches)
        # Every micro-batch's loss is divided by the step's count of valid labels, known before the
        # first backward: the micro-batches are fetched first (as torchtitan does).
        weight, group_loss_factor = self._label_weights([labels for _, labels in micro_batches])
        for micro, (inputs, labels) in enumerate(micro_batches):
            self._set_gradient_sync(micro == run.accum - 1)
            loss_sum += self.forward_backward(inputs, labels, weight)
            run.metrics.record_tokens(inputs.numel())
        if group_loss_factor is not None:
            loss_sum *= group_loss_factor
        return loss_sum

    def after_backward(self) -> None:
        """Phase 2, gradients complete on this rank: the partial ones reduced (the plan's reducer),
        the replica groups' average (fault tolerance), then the family's after_backward (MoE load
        balancing), whose metrics go on the step's log line."""
        run = self.run
        run.optimization.reduce_partial_grads(run.params)
        run.replicas.after_backward(run.params)
        self.family_metrics = run.job.family.after_backward(
            run.model_parts, run.groups.loss, run.groups.pp, cross_group=run.replicas.sum_across_groups
        )
        self.step_extra_losses, self.extra_losses = self.extra_losses, {}

    def unscale_and_clip(self) -> torch.Tensor:
        """Phase 3: gradients unscaled (fp16's loss scale) and clipped; returns the global norm."""
        run = self.run
        run.scaler.unscale_(run.optimizer)
        return clip_grad_norm_(run.params, self.config.training.max_norm, run.groups.pp, device=run.device)

    def gradients_finite(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Before the optimizer step: False for a non-finite norm that training.skip_nonfinite_steps
        skips (NonFiniteError when it may not).

        The one device->host read of a step, kept on purpose: skipping exactly (weights, AdamW
        moments and step counts, LR schedule untouched; NonFiniteError raised at this step) needs
        the flag before the optimizer step is launched. A skip on the device would need found_inf
        support in every optimizer kernel (torch's fused AdamW only, not foreach or
        AdamWMixedState) and a deferred LR step and counter. The read waits for backward + clip
        only; the optimizer kernels then cover the host's preparation of the next step, which no
        longer syncs itself (pinned non-blocking input copies, the stop poll on a gloo group)."""
        if self.run.scaler.enabled or torch.isfinite(grad_norm):
            # Under fp16 the scaler owns this case (skip + back off): it never reads the norm here.
            return True
        # The norm is global, so every rank takes the same branch.
        if not self.config.training.skip_nonfinite_steps:
            raise NonFiniteError(
                f"step {self.step}: gradient norm is {float(grad_norm)} (loss on this rank "
                f"{float(loss_sum)}); try a lower optimizer.lr or more lr_scheduler.warmup_steps, "
                f"training.max_norm > 0, bfloat16 instead of float16, or "
                f"training.skip_nonfinite_steps = true to skip such steps"
            )
        self.nonfinite_skipped += 1
        logger.warning(
            "step %d: non-finite gradient norm %s, step skipped (%d so far)",
            self.step,
            float(grad_norm),
            self.nonfinite_skipped,
        )
        return False

    def after_optimizer_step(self) -> None:
        """Phase 5, after an applied optimizer step: the LR schedule, fp8's scales of the next
        all-gather, the family's after_step (MoE's expert biases)."""
        run = self.run
        run.lr_scheduler.step()
        float8.after_optimizer_step(run.model_parts, run.plan.fp8_all_gather)
        run.job.family.after_step(run.model_parts)

    def _set_gradient_sync(self, sync: bool) -> None:
        """DDP, and FSDP under per-step fault tolerance, accumulate the micro-batches' gradients
        locally and reduce once, in the last micro-batch's backward (`sync`): the all-reduce
        across DDP's ranks, or across the replica groups (torchft's, in FSDP's all-reduce hook:
        its reduce-scatter runs once too, over unsharded gradients accumulated in the reduce
        dtype). Plain FSDP reduce-scatters every micro-batch (sharded gradients accumulate)."""
        for part in self.run.model_parts:
            if self.run.dims.ddp_enabled or self.run.replicas.syncs_once(part):
                # DDP's replicate() or FSDP2 made every part one of these.
                cast("ReplicateModule | FSDPModule", part).set_requires_gradient_sync(sync)

    def _next_micro_batches(
        self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's `accum` loader batches, on the device (waiting for them is data time)."""
        out = []
        for _ in range(self.run.accum):
            data_start = time.perf_counter()
            inputs, labels = next(batches)
            self.data_time_s += time.perf_counter() - data_start
            out.append((to_device(inputs, self.run.device), to_device(labels, self.run.device)))
        return out

    def train(self) -> None:
        """Steps up to training.steps (or a stop signal), validating, logging and saving at their
        intervals; with checkpoint.create_seed_checkpoint, only the step-0 checkpoint."""
        t, run = self.config.training, self.run
        if self.config.checkpoint.create_seed_checkpoint:
            run.checkpointer.save_seed()
            run.metrics.close()
            return
        batches = run.replicas.start(self, self.new_batches())
        tokens_per_step = t.local_batch_size * t.seq_len * run.accum * run.dims.dp_degree
        if run.is_logging_rank:
            logger.info(
                "training %d steps on %s (%s), world size %d",
                t.steps,
                run.device,
                run.info.backend,
                run.info.world_size,
            )
        first_step, checkpoints, ran = self.step, 0, 0
        run.metrics.start_run(first_step, t.steps)
        with (
            profiling.maybe_profile(self.config, run.info.rank, self.step) as prof,
            profiling.maybe_memory_snapshot(self.config, run.info.rank),
        ):
            while self.step < t.steps:
                self.step += 1
                if t.gc_freq and self.step % t.gc_freq == 0:
                    gc.collect(1)
                step_start = time.perf_counter()
                taken = run.replicas.take_step(self, batches)
                if taken is None:
                    break  # a stop signal while no step could be taken (fault tolerance: saved)
                batches, loss, grad_norm, lr = taken
                step_s = time.perf_counter() - step_start
                self.tokens_seen += tokens_per_step
                batches = run.replicas.after_step(self, batches, t.steps)
                ran += 1
                if ran == 1:
                    # Start-up (compile, first all-gathers) may be slow; steady state must not hang.
                    # Counted in steps this process ran: a heal sets self.step to the live group's.
                    process_groups.set_timeouts(self.config.comm.timeout_seconds, run.dims)
                maybe_inject_fault(self.config, self.step, run.info.rank)
                val = self._maybe_validate()
                if run.metrics.should_log(self.step) or self.step == t.steps or val:
                    self._log(loss, grad_norm, lr, val)
                stop = run.checkpointer.should_stop()  # SIGTERM/SIGUSR1 on any rank: save and exit
                saved_before = run.checkpointer.last_saved_step
                run.checkpointer.maybe_save(self.step, self.tokens_seen, last=self.step == t.steps, force=stop)
                checkpoints += run.checkpointer.last_saved_step != saved_before
                if run.deadline.warning_s and self.step > first_step + 1:  # the first step warms up
                    self._check_deadline(
                        step_s, "measured" if run.checkpointer.last_save_s else "measured step, estimated save:"
                    )
                if prof is not None:
                    prof.step()
                if stop:
                    break
        run.checkpointer.close()
        run.replicas.shutdown()
        run.metrics.log_summary(self.step, self.tokens_seen, checkpoints)
        run.metrics.close()

    def new_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """An iterator over the training loader, from where it stands."""
        # Creating the iterator draws a seed from the global RNG; fork so that a resumed run's RNG
        # (restored from the checkpoint) matches the uninterrupted run's.
        with torch.random.fork_rng(devices=[]):
            return iter(self.run.dataloader)

    def audit(self) -> AuditResult:
        """One train step checked against the precision plan (`mixed_precision.audit`, by
        precision/audit.py), instead of training: the step as the loop runs it (run.replicas)."""
        from torchtitan_amp.precision import audit

        run = self.run
        auditor = audit.Auditor(
            run.plan,
            run.model_parts,
            run.dims,
            optimizer=run.optimizer,
            params=run.params,
            n_layers=run.job.model_args.n_layers,
            cross_group=run.ft,
        )
        batches = self.new_batches()
        result = audit.audit_step(
            auditor, lambda: run.replicas.audited_step(self, batches), self.config.job.dump_folder, run.is_logging_rank
        )
        run.metrics.close()
        run.replicas.shutdown()
        return result

    def _maybe_validate(self) -> dict[str, float]:
        """The validation results when an evaluation is due at this step, else {}."""
        validator = self.run.validator
        if validator is None or not validator.spec.due(self.step, self.config.training.steps):
            return {}
        result = validator.run()
        self.run.metrics.exclude_time(result["val_time_s"])
        if validator.samples:
            self.run.metrics.log_samples(self.step, validator.samples)
        return result

    def evaluate(self) -> dict[str, float]:
        """One evaluation of the current (loaded) weights, outside training (tools/evaluate.py)."""
        if self.run.validator is None:
            raise ConfigError("evaluation needs validation.enable = true")
        return self.run.validator.run()

    def _log(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, val: dict[str, float] | None = None) -> None:
        """One metrics row: the step's mean loss over the loss ranks (NonFiniteError when it is not
        finite and nothing may skip it), the gradient norm, LR and the run's counters."""
        run = self.run
        for value in self.step_extra_losses.values() if run.groups.pp is not None else []:
            dist.all_reduce(value, group=run.groups.pp)  # the last stage's; the others hold 0
        extra = {
            "tokens_seen": float(self.tokens_seen),
            "epoch": float(run.dataloader.epoch),
            "step_time_s": run.metrics.step_time_s(self.step),
            "data_time_s": self.data_time_s,
            **{k: float(v) for k, v in self.family_metrics.items()},
            # Like the loss: each rank's share times the loss group's size, their mean the step's.
            **{k: process_groups.mean_across(v, run.groups.loss) for k, v in self.step_extra_losses.items()},
            **(val or {}),
        }
        self.data_time_s = 0.0
        if self.nonfinite_skipped:
            extra["nonfinite_skipped"] = float(self.nonfinite_skipped)
        extra.update(run.replicas.metrics())
        if run.scaler.enabled:
            extra.update(loss_scale=run.scaler.get_scale(), skipped_steps=float(run.scaler.skipped_steps))
        if run.groups.pp is not None:
            # Only the last stage computed the loss; the others hold 0.
            loss = loss.clone()
            dist.all_reduce(loss, group=run.groups.pp)
        # Each rank's loss is its share of the step's label sum times the loss group's size
        # (label_weight): their mean over the data- and context-parallel ranks is the step's mean.
        mean_loss = process_groups.mean_across(loss, run.groups.loss)
        if not math.isfinite(mean_loss) and not run.scaler.enabled and not self.config.training.skip_nonfinite_steps:
            raise NonFiniteError(
                f"step {self.step}: loss is {mean_loss}; try a lower optimizer.lr, "
                f"training.max_norm > 0, or training.skip_nonfinite_steps = true"
            )
        run.metrics.log(self.step, mean_loss, float(grad_norm), lr, extra)


def train_in_turn(
    runs: list[tuple[Path, list[str]]], inspect: Callable[[Trainer], dict] | None = None
) -> Iterator[tuple[int, float]]:
    """Several jobs in one launch (tests, numerics_matrix), process start-up paid once: for each (dump
    folder, overrides) in turn, a fresh Trainer and `train()`, exactly what train.py does. A run
    that raises writes FOLDER/error_rank{R}.txt and re-raises, so later runs do not start. With
    `inspect`, every rank writes FOLDER/rank{R}.json = inspect(trainer) after training. Yields
    (index of the run, seconds it took) once every rank has finished it."""
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
