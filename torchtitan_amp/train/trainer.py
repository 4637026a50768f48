"""The training loop: config -> dims -> precision plan -> model -> parallelize -> steps."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_amp import memory
from torchtitan_amp.checkpoint import CheckpointManager
from torchtitan_amp.checkpoint.preemption import DeadlineCheck, maybe_inject_fault
from torchtitan_amp.config import ConfigError, JobConfig, load_config, to_toml
from torchtitan_amp.core.errors import NonFiniteError
from torchtitan_amp.data import build_dataloader
from torchtitan_amp.data.loader import to_device
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.distributed.context_parallel import BatchSharder
from torchtitan_amp.distributed.pipeline import Pipeline, build_pipeline
from torchtitan_amp.distributed.tensor_parallel import parallel_context
from torchtitan_amp.eval import validation
from torchtitan_amp.models.loss import count_valid_labels, label_weight, loss_fn
from torchtitan_amp.observability import profiling
from torchtitan_amp.observability.metrics import MetricsLogger, peak_flops, peak_label, remeasure_cpu_peak
from torchtitan_amp.observability.trackers import build_trackers
from torchtitan_amp.precision import autocast, float8, reducers, report, scaler
from torchtitan_amp.train.job import build_model_parts
from torchtitan_amp.train.job import resolve as resolve_job
from torchtitan_amp.train.optim import build_lr_scheduler, build_optimizer

if TYPE_CHECKING:
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


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global grad norm (over every shard and pipeline stage), clipping when max_norm > 0."""
    groups = _grad_groups(params)
    squares = []
    for grads in groups:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    # A stage whose parameters got no gradient still joins the pipeline all-reduce, on their device.
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=params[0].device if params else None)
    if pp_group is not None:
        # Stages hold disjoint parameters: add squared norms across them.
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


class Trainer:
    def __init__(self, config: JobConfig) -> None:
        self.config = config
        t = config.training
        # Everything that can reject the config runs before any process group exists.
        self.info = process_groups.resolve(config)
        # Before the plan: its probes run CUDA matmuls, which would open a context on cuda:0 on
        # every local rank and fix cuBLAS's workspace before determinism could configure it.
        process_groups.set_device(self.info)
        process_groups.set_determinism(t.deterministic)
        self.job = resolve_job(config, self.info.world_size, self.info.device.type)
        self.dims, self.accum, self.plan = self.job.dims, self.job.accum, self.job.plan
        self.model_args = self.job.model_args
        # Bad data is a config-time error too: the loader is built before any process group.
        dp_rank = self.dims.dp_rank(self.info.rank)
        self.dataloader = build_dataloader(t.dataset, self.job.tokenizer, t.seq_len, t.local_batch_size,
                                           dp_rank, self.dims.dp_degree, t.seed,
                                           num_workers=t.dataloader_num_workers,
                                           pin_memory=self.info.device.type == "cuda",
                                           samples_per_step=t.local_batch_size * self.dims.dp_degree * self.accum)
        spec = self.job.validation
        val_loader = (validation.build_loader(spec, self.job.tokenizer, dp_rank, self.dims.dp_degree, t.seed)
                      if spec is not None else None)

        process_groups.init(self.info, config.comm.init_timeout_seconds)
        self.device = self.info.device
        self.is_logging_rank = self.info.rank == 0
        if self.is_logging_rank and config.job.print_config:
            logger.info("resolved config:\n%s", to_toml(config))
        self._build_groups()
        # What this rank's model sees of a batch: document ids, and its chunks under CP.
        self.model_inputs = BatchSharder(self.job.mask_inputs, self.dims.cp, self.dims.cp_rank(self.info.rank))
        self.scaler = scaler.build_scaler(self.plan)
        self.pipeline: Pipeline | None = None
        self._label_weight = torch.ones((), device=self.device)  # set per step (forward_backward)
        self.model_parts = self._build_model()
        self.model = self.model_parts[0]
        self.validator = None if spec is None else validation.Validator(
            spec, val_loader, config=config, plan=self.plan, dims=self.dims, model_parts=self.model_parts,
            pipeline=self.pipeline, loss_fn=loss_fn, model_inputs=self.model_inputs, device=self.device,
            loss_group=self.loss_group,
            pp_group=self.pp_group, is_logging_rank=self.is_logging_rank)
        self.params = [p for m in self.model_parts for p in m.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, config.optimizer, self.device,
                                         state_dtype=(self.plan.optimizer_state_dtype
                                                      if self.plan.mixed_state_optimizer else None),
                                         stochastic_rounding=self.plan.stochastic_rounding, seed=t.seed,
                                         fused_ok=self.plan.fused_optimizer_ok)
        self.reduce_partial_grads = reducers.partial_grad_reducer(self.plan, self.model_parts)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, t.steps)
        written = report.log_and_write_report(self.plan, nn.ModuleList(self.model_parts), config.job.dump_folder,
                                              self.is_logging_rank, self._memory_facts())
        self.metrics = self._build_metrics(written)
        self.step = 0
        self.tokens_seen = 0
        self.family_metrics: dict[str, torch.Tensor] = {}  # the family's per-step numbers (MoE load)
        self.nonfinite_skipped = 0
        self.data_time_s = 0.0
        self.checkpointer = CheckpointManager(
            config, model=self.model_parts, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            scaler=self.scaler, dataloader=self.dataloader, model_args=self.model_args,
            device=self.device, pp_degree=self.dims.pp, validator=self.validator)
        resumed = self.checkpointer.load()
        if resumed is not None:
            self.step, self.tokens_seen = resumed.step, resumed.tokens_seen
        self.deadline = DeadlineCheck(config.checkpoint.preemption_warning_s if self.checkpointer.enabled else 0)
        self.estimated_save_s = 0.0
        if self.deadline.warning_s:
            self.estimated_save_s = self._estimate_save()
            self._check_deadline(0.0, "start-up estimate:")

    def _build_metrics(self, precision_report: dict[str, object]) -> MetricsLogger:
        """The metrics logger and its trackers, which get the job config and the precision report."""
        config, dtypes = self.config, self.plan.compute_dtypes
        metrics = MetricsLogger(
            config.job.dump_folder, log_freq=config.metrics.log_freq, enable_tensorboard=False,
            trackers=build_trackers(config) if self.is_logging_rank else (), is_logging_rank=self.is_logging_rank,
            flops_per_token=self.flops_per_token, peak_flops=peak_flops(self.device, dtypes), device=self.device,
            num_ranks_for_mfu=self.dims.tp * self.dims.pp * self.dims.cp, peak_label=peak_label(self.device, dtypes),
            remeasure_peak=partial(remeasure_cpu_peak, dtypes) if self.device.type == "cpu" else None,
        )
        metrics.describe_run({**config.to_dict(), "precision_report": precision_report},
                             [Path(config.job.dump_folder) / "precision_report.json"])
        if self.is_logging_rank:
            logger.info("mfu is relative to %s", metrics.describe_peak())
        return metrics

    def _build_groups(self) -> None:
        """The mesh, and the groups the loop itself talks over (data, loss, pipeline)."""
        self.dp_group, self.pp_group, self.loss_group = None, None, None
        if self.info.world_size == 1:
            return
        mesh = self.dims.build_mesh(self.device.type)
        assert self.dims.dp_mesh.get_local_rank() == self.dims.dp_rank(self.info.rank)
        assert mesh["cp"].get_local_rank() == self.dims.cp_rank(self.info.rank)
        self.dp_group = self.dims.dp_mesh.get_group()
        # Every rank holding a share of the step's tokens: cp ranks hold parts of one window.
        self.loss_group = self.dims.loss_mesh.get_group()
        self.pp_group = mesh["pp"].get_group() if self.dims.pp_enabled else None

    def _memory_facts(self) -> dict[str, object]:
        """This rank's gradient collectives per step and the bytes per parameter, from the memory
        model (the dry run's numbers, which tests check against real traffic)."""
        coords = self.dims.coordinates(self.info.world_size)
        prec = self.job.precision
        return {"gradient_collectives": memory.grad_comm(self.job.model_dims, prec, self.job.layout,
                                                         pp_rank=coords["pp"], tp_rank=coords["tp"]),
                "bytes_per_param": prec.bytes_per_param()}

    def _estimate_save(self) -> float:
        size, save_s = self.checkpointer.estimate_save_s()
        if self.is_logging_rank:
            logger.info("pre-emption: %d s warning; a save writes %.2f GiB on this rank, estimated "
                        "%.1f s on the slowest rank", self.deadline.warning_s, size / 2**30, save_s)
        return save_s

    def _check_deadline(self, step_s: float, basis: str) -> None:
        """Warn (once per basis) when a step plus the last measured save, or the estimate before
        any save, would not fit in the pre-emption warning."""
        save_s = self.checkpointer.last_save_s or self.estimated_save_s
        problem = self.deadline.problem(step_s, save_s, basis)
        if problem and self.is_logging_rank:
            logger.warning(problem)

    def _build_model(self) -> list[nn.Module]:
        """This rank's model parts (job.build_model_parts); under PP, wrapped in a schedule."""
        pp_rank = self.dims.mesh["pp"].get_local_rank() if self.dims.pp_enabled else 0
        built = build_model_parts(self.job, self.device, self.job.stage_ids(pp_rank))
        self.flops_per_token = built.flops_per_token
        if self.dims.pp_enabled:
            self.pipeline = build_pipeline(
                built.parts, built.stage_ids, self.job.num_stages, self.job.n_microbatches, self.dims,
                self.config.parallelism.pipeline_parallel_schedule, self.device, self._pipeline_loss,
                self._pipeline_eval_loss, partial(autocast.apply_forward_context, self.plan),
                self.config.parallelism.pipeline_fsdp_reduce)
        if self.is_logging_rank:
            logger.info("model %s: %s parameters, %.3g FLOPs/token, %d-step grad accumulation",
                        self.config.model.flavor, f"{built.num_params:,}", self.flops_per_token, self.accum)
        return built.parts

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
        grad_mean_size = dist.get_world_size(self.loss_group) if self.loss_group is not None else 1
        return label_weight(count_valid_labels(labels, self.dp_group), grad_mean_size)

    def _set_loss_factor(self, divisor: int) -> None:
        """Losses the model adds itself (MoE's auxiliary loss) get the trainer's loss factor."""
        if self.job.family.set_loss_factor is not None:
            self.job.family.set_loss_factor(self.model_parts, self.scaler.get_scale() / divisor)

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        autocast.check_no_user_autocast(self.plan)
        self.optimizer.zero_grad(set_to_none=True)
        # fp32 accumulator: a low-precision running sum stalls once it is large enough.
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        micro_batches = self._next_micro_batches(batches)
        # Every micro-batch's loss is divided by the step's count of valid labels, known before the
        # first backward: the micro-batches are fetched first (as torchtitan does).
        weight = self._step_label_weight([labels for _, labels in micro_batches])
        for micro, (inputs, labels) in enumerate(micro_batches):
            if self.dims.ddp_enabled:
                # Accumulate locally; the last micro-batch's backward all-reduces the sum once.
                for part in self.model_parts:
                    part.set_requires_gradient_sync(micro == self.accum - 1)
            loss_sum += self.forward_backward(inputs, labels, weight)
            self.metrics.record_tokens(inputs.numel())
        self.reduce_partial_grads(self.params)
        if self.job.family.after_backward is not None:
            self.family_metrics = self.job.family.after_backward(self.model_parts, self.loss_group, self.pp_group)
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm_(self.params, self.config.training.max_norm, self.pp_group)
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
        t = self.config.training
        if self.config.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            self.metrics.close()
            return
        # Creating the iterator draws a seed from the global RNG; fork so that a resumed run's RNG
        # (restored from the checkpoint) matches the uninterrupted run's.
        with torch.random.fork_rng(devices=[]):
            batches = iter(self.dataloader)
        tokens_per_step = t.local_batch_size * t.seq_len * self.accum * self.dims.dp_degree
        if self.is_logging_rank:
            logger.info("training %d steps on %s (%s), world size %d", t.steps, self.device,
                        self.info.backend, self.info.world_size)
        first_step, checkpoints = self.step, 0
        self.metrics.start_run(first_step, t.steps)
        with profiling.maybe_profile(self.config, self.info.rank, self.step) as prof, \
                profiling.maybe_memory_snapshot(self.config, self.info.rank):
            while self.step < t.steps:
                self.step += 1
                if t.gc_freq and self.step % t.gc_freq == 0:
                    gc.collect(1)
                lr = self.lr_scheduler.get_last_lr()[0]
                step_start = time.perf_counter()
                loss, grad_norm, _ = self.train_step(batches)
                step_s = time.perf_counter() - step_start
                self.tokens_seen += tokens_per_step
                if self.step == first_step + 1:
                    # Start-up (compile, first all-gathers) may be slow; steady state must not hang.
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
        self.metrics.log_summary(self.step, self.tokens_seen, checkpoints)
        self.metrics.close()

    def audit(self) -> "AuditResult":
        """One train step with dtype recorders on, checked against the precision plan
        (mixed_precision.audit); the logging rank writes precision_audit.json and the table."""
        from torchtitan_amp.precision import audit

        with torch.random.fork_rng(devices=[]):
            batches = iter(self.dataloader)
        result = audit.Auditor(self).run(batches)
        if self.is_logging_rank:
            path = audit.write(result, self.config.job.dump_folder)
            logger.info("%s\n  written to %s", audit.table(result), path)
        self.metrics.close()
        return result

    def _maybe_validate(self) -> dict[str, float]:
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
        extra = {"tokens_seen": float(self.tokens_seen), "epoch": float(self.dataloader.epoch),
                 "step_time_s": self.metrics.step_time_s(self.step),
                 "data_time_s": self.data_time_s, **{k: float(v) for k, v in self.family_metrics.items()},
                 **(val or {})}
        self.data_time_s = 0.0
        if self.nonfinite_skipped:
            extra["nonfinite_skipped"] = float(self.nonfinite_skipped)
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
