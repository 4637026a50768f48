"""Validation: the loss on a held-out split, under the run's own precision plan and layout.

Every evaluation forward runs in its own outermost autocast region (the plan's forward context,
entered per batch): autocast caches the low-precision copies of weights it casts inside a region,
and a copy cast under `no_grad` and reused by a later grad-enabled forward of the same region has
no autograd history, so that forward's weights would get no gradients (pytorch/pytorch#65766).
Evaluation touches nothing training reads: its own data loader, no RNG draws outside a forked RNG,
FSDP parameters resharded and every module back in its previous train/eval mode afterwards.
With `validation.sample_prompts`, every evaluation also generates their continuations (greedy
by default, generation.py) on every rank, in the same eval-mode, no-grad region.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan_amp.config import ConfigError, JobConfig
from torchtitan_amp.core.errors import DataError
from torchtitan_amp.data import ParallelAwareDataLoader, build_dataloader
from torchtitan_amp.data.loader import to_device
from torchtitan_amp.data.tokenizer import Tokenizer
from torchtitan_amp.distributed.context_parallel import check_seq_len
from torchtitan_amp.distributed.pipeline import Pipeline
from torchtitan_amp.distributed.tensor_parallel import parallel_context
from torchtitan_amp.eval.generation import ModelRunner, SamplePrompts, resolve_samples
from torchtitan_amp.models.loss import IGNORE_INDEX
from torchtitan_amp.precision import PrecisionPlan, autocast

# A batch -> (inputs, labels, keyword inputs) as this rank's model sees it.
ModelInputs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]

logger = logging.getLogger("torchtitan_amp")

# The fields an evaluation adds to metrics.jsonl, TensorBoard and the log line.
FIELDS = ("val_loss", "val_ppl", "val_tokens", "val_time_s")


@dataclass(frozen=True)
class ValidationSpec:
    """The [validation] section resolved against training's settings."""

    dataset: str
    held_out: bool  # False: evaluating on the training data (validation.dataset left empty)
    seq_len: int
    local_batch_size: int
    steps: int  # batches per evaluation; -1: the whole split once
    freq: int
    samples: SamplePrompts | None = None  # validation.sample_prompts to continue at each evaluation

    def due(self, step: int, last_step: int) -> bool:
        return step % self.freq == 0 or step == last_step


def resolve_spec(
    config: JobConfig, max_seq_len: int, pp_microbatches: int | None, tokenizer: Tokenizer | None = None
) -> ValidationSpec | None:
    """What validation runs on, from the config; None when validation is off. Checks what needs
    training's settings or the layout (ConfigError).

    Args:
        config: the job config (its validation section, falling back to training's values).
        max_seq_len: the rotary tables' length, which a validation seq_len must fit.
        pp_microbatches: the pipeline schedule's fixed micro-batch count, which the validation
            local batch size must divide by; None without pipeline parallelism.
        tokenizer: encodes the sample prompts; None: a dry run, which generates none.
    """
    v, t = config.validation, config.training
    if not v.enable:
        return None
    spec = ValidationSpec(
        dataset=v.dataset or t.dataset,
        held_out=bool(v.dataset),
        seq_len=v.seq_len or t.seq_len,
        local_batch_size=v.local_batch_size or t.local_batch_size,
        steps=v.steps,
        freq=v.freq,
        samples=resolve_samples(config, tokenizer, max_seq_len),
    )
    if spec.seq_len > max_seq_len:
        raise ConfigError(
            f"'validation.seq_len' = {spec.seq_len} exceeds training.seq_len = {max_seq_len}, "
            "the longest sequence the model's rotary tables cover"
        )
    # Evaluation windows are split over the cp ranks like training's.
    check_seq_len(spec.seq_len, config.parallelism.context_parallel_degree, "validation.seq_len")
    if pp_microbatches is not None and spec.local_batch_size % pp_microbatches:
        raise ConfigError(
            f"'validation.local_batch_size' = {spec.local_batch_size} must be a multiple of the pipeline's "
            f"{pp_microbatches} microbatches (training.local_batch_size / "
            "parallelism.pipeline_parallel_microbatch_size): the schedule evaluates in the same number"
        )
    return spec


def build_loader(
    spec: ValidationSpec, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, seed: int
) -> ParallelAwareDataLoader:
    """The validation loader; a split that cannot fill one batch per rank is a DataError naming
    validation.dataset (raised before any process group exists).

    Args:
        spec: what validation runs on (dataset, seq_len, local batch size).
        tokenizer: the run's tokenizer.
        dp_rank: this rank's data-parallel index, 0 .. dp_degree - 1.
        dp_degree: the data-parallel degree.
        seed: the seed of the sequence order.
    """
    try:
        loader = build_dataloader(
            spec.dataset, tokenizer, spec.seq_len, spec.local_batch_size, dp_rank, dp_degree, seed
        )
    except DataError as e:
        raise DataError(f"'validation.dataset' = {spec.dataset!r}: {e}") from e
    if loader.num_windows_per_epoch < spec.local_batch_size:
        raise DataError(
            f"'validation.dataset' = {spec.dataset!r} has {loader.num_windows_per_epoch} windows of "
            f"seq_len {spec.seq_len} + 1 tokens per data-parallel rank ({dp_degree} ranks), fewer than "
            f"one batch of validation.local_batch_size = {spec.local_batch_size}"
        )
    return loader


class Validator:
    """Evaluates this rank's model parts on the validation loader; every rank must call `run`."""

    def __init__(
        self,
        spec: ValidationSpec,
        loader: ParallelAwareDataLoader,
        *,
        config: JobConfig,
        plan: PrecisionPlan,
        dims: Any,
        model_parts: list[nn.Module],
        pipeline: Pipeline | None,
        loss_fn: Callable[..., torch.Tensor],
        device: torch.device,
        loss_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        is_logging_rank: bool,
        model_inputs: ModelInputs = lambda x, y: (x, y, {}),
    ) -> None:
        """loss_group: every rank holding a share of a step's tokens (data- and context-parallel);
        model_inputs: a batch -> what this rank's model sees (context_parallel.BatchSharder)."""
        self.spec, self.loader, self.loss_fn, self.model_inputs = spec, loader, loss_fn, model_inputs
        self.config, self.plan, self.dims = config, plan, dims
        self.model_parts, self.pipeline, self.device = model_parts, pipeline, device
        self.loss_group, self.pp_group = loss_group, pp_group
        # steps = -1 starts every evaluation from here: the same windows each time.
        self._start = loader.state_dict()
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.samples: list[dict[str, Any]] = []  # the last evaluation's sample continuations
        if not spec.held_out and is_logging_rank:
            logger.warning(
                "validation.dataset is empty: evaluating on the training data (%s), which "
                "measures fit, not generalisation",
                spec.dataset,
            )

    @property
    def batches_per_run(self) -> int:
        if self.spec.steps != -1:
            return self.spec.steps
        return self.loader.num_windows_per_epoch // self.spec.local_batch_size

    def run(self) -> dict[str, float]:
        """One evaluation: the mean loss over every evaluated valid label (not ignore_index) of
        every data-parallel rank, its perplexity, the count of those labels and the wall time (sample generation
        included; the continuations are in `self.samples`)."""
        autocast.check_no_user_autocast(self.plan)
        start = time.perf_counter()
        modes = [m.training for part in self.model_parts for m in part.modules()]
        for part in self.model_parts:
            part.eval()
        # [sum of per-token losses, tokens] on this rank; fp64 so that a long split sums exactly enough.
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad():
                batches = self._iterator()
                for _ in range(self.batches_per_run):
                    inputs, labels = next(batches)
                    total += self._loss_sum(to_device(inputs, self.device), to_device(labels, self.device))
            if self.spec.samples is not None:
                p = self.config.parallelism
                runner = ModelRunner.for_plan(self.model_parts[0], self.plan, self.dims.tp, p.enable_sequence_parallel)
                self.samples = self.spec.samples.generate(runner)
        finally:
            self._restore(modes)
        for group in (self.pp_group, self.loss_group):  # stages first: only the last one holds losses
            if group is not None:
                dist.all_reduce(total, group=group)
        # No valid label at all: loss 0 (a sum of nothing), not 0 / 0.
        loss, tokens = float(total[0] / total[1].clamp(min=1)), float(total[1])
        return {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 700.0)),
            "val_tokens": tokens,
            "val_time_s": time.perf_counter() - start,
        }

    def _iterator(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.spec.steps == -1:
            self.loader.load_state_dict(self._start)
            self._batches = None
        if self._batches is None:
            # Creating the iterator draws a seed from the global RNG: fork, or training's RNG moves.
            with torch.random.fork_rng(devices=[]):
                self._batches = iter(self.loader)
        return self._batches

    def _loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[sum of this batch's per-label losses, its count of valid labels (not ignore_index)] as
        seen by this rank: zeros on pipeline stages without the loss. Sums, not means, so that
        ranks and batches with fewer valid labels weigh less, exactly."""
        inputs, labels, extra = self.model_inputs(inputs, labels)
        if self.pipeline is not None:
            with parallel_context(self.dims, self.config):
                losses = self.pipeline.evaluate(inputs, labels, **extra)  # per-microbatch sums
            if not losses:
                return torch.zeros(2, dtype=torch.float64, device=self.device)
            loss = torch.stack(losses).sum()
        else:
            # Its own outermost autocast region per forward (see the module docstring).
            with parallel_context(self.dims, self.config), autocast.forward_context(self.plan):
                loss = self.loss_fn(
                    autocast.cast_output(self.plan, self.model_parts[0](inputs, **extra)), labels, reduction="sum"
                )
            if isinstance(loss, DTensor):  # loss parallel: a replicated DTensor
                loss = loss.full_tensor()
        return torch.stack([loss.double(), (labels != IGNORE_INDEX).sum().double()])

    def _restore(self, modes: list[bool]) -> None:
        """Modules back in their previous train/eval mode; FSDP parameters resharded (a forward
        without backward leaves the modules that do not reshard after forward unsharded)."""
        modules = [m for part in self.model_parts for m in part.modules()]
        for module, training in zip(modules, modes, strict=True):
            module.training = training
            if isinstance(module, FSDPModule):
                module.reshard()

    def state_dict(self) -> dict[str, Any]:
        """The loader's position when evaluations continue through the split (steps != -1)."""
        return self.loader.state_dict() if self.spec.steps != -1 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and self.spec.steps != -1:
            self.loader.load_state_dict(state)
            self._batches = None
