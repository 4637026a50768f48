"""The training loop: config -> dims -> precision plan -> model -> parallelize -> steps."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_amp import distributed
from torchtitan_amp.config import ConfigError, JobConfig, Training, to_toml
from torchtitan_amp.data import build_dataloader
from torchtitan_amp.metrics import MetricsLogger, peak_flops
from torchtitan_amp.models.llama import Transformer, build_model_args, count_params, flops_per_token
from torchtitan_amp.optim import build_lr_scheduler, build_optimizer
from torchtitan_amp.parallel_dims import ParallelDims
from torchtitan_amp.parallelize import parallelize_llama, validate_layout
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.tokenizer import build_tokenizer

logger = logging.getLogger("torchtitan_amp")

# Below this size every rank initialises the full model from the seed and then shards it, so any
# parallel layout starts from bit-identical weights; above it, init happens on the sharded params.
FULL_INIT_MAX_PARAMS = 2_000_000_000


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on fp32 logits, whatever dtype the model produced them in."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def grad_accum_steps(t: Training, dp_degree: int) -> int:
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"'training.global_batch_size' = {t.global_batch_size} is not a multiple of "
            f"local_batch_size x dp degree = {t.local_batch_size} x {dp_degree} = {per_step}"
        )
    return t.global_batch_size // per_step


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global grad norm (over every shard), clipping when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def _cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only: rotary buffers must stay fp32 even in pure low-precision training."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(p.detach().to(dtype), p.requires_grad))


class Trainer:
    def __init__(self, config: JobConfig) -> None:
        self.config = config
        t = config.training
        # Everything that can reject the config runs before any process group exists.
        self.info = distributed.resolve(config)
        self.dims = ParallelDims.from_config(config.parallelism, self.info.world_size)
        validate_layout(self.dims)
        self.accum = grad_accum_steps(t, self.dims.dp_degree)
        self.plan = PrecisionPlan.from_config(config, self.dims, self.info.device.type)
        tokenizer = build_tokenizer(config.model.tokenizer)
        self.model_args = build_model_args(config.model.flavor, tokenizer.vocab_size, t.seq_len)

        distributed.init(self.info)
        self.device = self.info.device
        self.is_logging_rank = self.info.rank == 0
        if self.is_logging_rank and config.job.print_config:
            logger.info("resolved config:\n%s", to_toml(config))
        dp_rank, dp_group = 0, None
        if self.info.world_size > 1:
            mesh = self.dims.build_mesh(self.device.type)
            dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
        self.dp_group = dp_group
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.dataloader = build_dataloader(t.dataset, tokenizer, t.seq_len, t.local_batch_size,
                                           dp_rank, self.dims.dp_degree, t.seed)
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, config.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, t.steps)
        self.scaler = self.plan.build_scaler()
        self.plan.log_and_write_report(self.model, config.job.dump_folder, self.is_logging_rank)
        self.metrics = MetricsLogger(
            config.job.dump_folder, log_freq=config.metrics.log_freq,
            enable_tensorboard=config.metrics.enable_tensorboard,
            tensorboard_folder=config.metrics.save_tb_folder, is_logging_rank=self.is_logging_rank,
            flops_per_token=self.flops_per_token,
            peak_flops=peak_flops(self.device, self.plan.param_dtype), device=self.device,
        )
        self.step = 0

    def _build_model(self) -> nn.Module:
        args, t = self.model_args, self.config.training
        with torch.device("meta"):
            model = Transformer(args)
        _cast_params(model, self.plan.storage_dtype)
        num_params = count_params(model)
        self.flops_per_token = flops_per_token(args, count_params(model, exclude_embedding=True), t.seq_len)
        torch.manual_seed(t.seed)
        if num_params <= FULL_INIT_MAX_PARAMS:
            model.to_empty(device="cpu")
            with torch.no_grad():
                model.init_weights()
            model.to(self.device)
            parallelize_llama(model, self.dims, self.plan, self.config)
        else:
            parallelize_llama(model, self.dims, self.plan, self.config)
            model.to_empty(device=self.device)
            with torch.no_grad():
                model.init_weights(buffer_device=self.device)
        if self.is_logging_rank:
            logger.info("model %s: %s parameters, %.3g FLOPs/token, %d-step grad accumulation",
                        self.config.model.flavor, f"{num_params:,}", self.flops_per_token, self.accum)
        return model.train()

    # -----------------------------------------------------------------------------------------

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch: forward + loss under the plan's forward context, backward outside it."""
        with self.plan.forward_context():
            logits = self.plan.cast_output(self.model(inputs))
            loss = loss_fn(logits, labels) / self.accum
        with self.plan.backward_context():
            self.scaler.scale(loss).backward()
        return loss.detach()

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        self.plan.check_no_user_autocast()
        self.optimizer.zero_grad(set_to_none=True)
        # fp32 accumulator: a low-precision running sum stalls once it is large enough.
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(self.accum):
            inputs, labels = next(batches)
            if self.dims.ddp_enabled:
                # Accumulate locally; the last micro-batch's backward all-reduces the sum once.
                self.model.set_requires_gradient_sync(micro == self.accum - 1)
            loss_sum += self.forward_backward(inputs.to(self.device), labels.to(self.device)).float()
            self.metrics.record_tokens(inputs.numel())
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm)
        stepped = self.scaler.step(self.optimizer)
        if stepped:
            # A skipped fp16 step must not advance the schedule.
            self.lr_scheduler.step()
        return loss_sum, grad_norm, stepped

    def train(self) -> None:
        t = self.config.training
        batches = iter(self.dataloader)
        logger.info("training %d steps on %s (%s), world size %d", t.steps, self.device,
                    self.info.backend, self.info.world_size) if self.is_logging_rank else None
        start = time.perf_counter()
        while self.step < t.steps:
            self.step += 1
            if t.gc_freq and self.step % t.gc_freq == 0:
                gc.collect(1)
            lr = self.lr_scheduler.get_last_lr()[0]
            loss, grad_norm, _ = self.train_step(batches)
            if self.metrics.should_log(self.step) or self.step == t.steps:
                self._log(loss, grad_norm, lr)
        if self.is_logging_rank:
            logger.info("finished %d steps in %.1f s", self.step, time.perf_counter() - start)
        self.metrics.close()

    def _log(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        extra = {"epoch": float(self.dataloader.epoch)}
        if self.scaler.enabled:
            extra.update(loss_scale=self.scaler.get_scale(), skipped_steps=float(self.scaler.skipped_steps))
        self.metrics.log(self.step, distributed.mean_across(loss, self.dp_group), float(grad_norm), lr, extra)
