"""The pipeline stage torch's schedules run (pipeline.build_pipeline): torch's PipelineStage made
to accumulate gradients under `replicate()` and to keep per-step counters out of its metadata
pass. A module of its own so that importing torchtitan_amp.distributed.pipeline does not import
torch.distributed.pipelining (which imports dynamo) in runs without pipeline parallel."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed._composable.replicate import DDP as ReplicateModule
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.nn.parallel.distributed import _find_tensors


class Stage(PipelineStage):
    """A stage that accumulates gradients over microbatches under `replicate()` (our DDP).

    torch's PipelineStage special-cases the `DistributedDataParallel` class and FSDP modules, not
    the composable `replicate()`: its reducer, armed by every forward, all-reduced after the first
    microbatch's backward and ignored the rest, so each rank kept avg(g_1) + its own g_2..g_n.
    As torch does for the DDP class: no forward arms the reducer (metadata inference's included),
    backwards accumulate locally, and the last microbatch's backward arms it, so one all-reduce
    (through the comm hook) carries the summed gradient.
    """

    def __init__(self, submod: nn.Module, *args: Any, reduce_per_microbatch: bool = False, **kwargs: Any) -> None:
        super().__init__(submod, *args, **kwargs)
        # parallelism.pipeline_fsdp_reduce = "per_microbatch": FSDP runs every microbatch's
        # backward as a plain one (reshard, reduce-scatter) instead of torch's no-sync accumulation.
        self._fsdp_per_microbatch = reduce_per_microbatch and isinstance(submod, FSDPModule)
        self._replicate = replicate.state(submod) if isinstance(submod, ReplicateModule) else None
        if self._replicate is not None:
            # Runs after replicate's own pre-hook, before its post-hook (which would arm).
            submod.register_forward_pre_hook(self._disarm)

    def _disarm(self, module: nn.Module, args: tuple) -> None:
        assert self._replicate is not None  # registered only on a replicate() stage
        self._replicate._ddp.require_backward_grad_sync = False

    # torch's metadata inference runs a real forward (2.13: and backward) through the stage before
    # the first microbatch; counters a module keeps per step (MoE token loads) must not see it.
    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._prepare_forward_infra(*args, **kwargs)
        reset_step_counters(self.submod)
        return result

    # The metadata pass materialises a later stage's inputs from their metadata with torch.empty:
    # uninitialised memory, which may hold NaN, goes through a real forward. Zeros instead, so a
    # module that checks its inputs (block-scaled quantization refuses non-finite blocks) and the
    # pass itself see finite values, the same on every run.
    def _to_tensor(self, arg: Any) -> torch.Tensor:
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                t.zero_()
        return t

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._prepare_backward_infra(*args, **kwargs)
        reset_step_counters(self.submod)
        return result

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        """One microbatch's backward through torch's stage, with this stage's reduction: FSDP's own
        post-backward every microbatch under pipeline_fsdp_reduce = "per_microbatch"; a
        `replicate()` stage's reducer armed on the step's last backward only (none when the trainer
        accumulates the whole step); otherwise torch's. Returns what torch's method returns.

        Args:
            backward_type: torch's schedule backward kind: "full", or "input" / "weight" of a
                split-backward schedule (those two refused here where the stage reduces itself).
            bwd_kwargs: torch's backward inputs: "stage_output", "output_grads", "input_values".
            last_backward: True for the step's last microbatch, the one that reduces gradients.
        """
        if self._fsdp_per_microbatch:
            return self._fsdp_backward(backward_type, bwd_kwargs)
        state = self._replicate
        # _no_sync set by the trainer means "accumulate this whole step" (gradient accumulation).
        if state is not None and last_backward and not state._no_sync:
            if backward_type != "full":
                raise NotImplementedError("replicate() stages support only full-backward schedules")
            state._ddp.reducer.prepare_for_backward(list(_find_tensors(bwd_kwargs["stage_output"])))
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _fsdp_backward(self, backward_type: str, bwd_kwargs: dict[str, Any]) -> Any:
        """One microbatch's backward with FSDP's own post-backward: each group reshards its
        parameters and reduce-scatters its gradient into the sharded (reduce dtype) one, so no
        unsharded gradient outlives the microbatch. torch's base method would turn both off until
        the step's last microbatch; its perform_reduce_grad then finds nothing left to reduce."""
        if backward_type != "full":
            raise NotImplementedError("pipeline_fsdp_reduce = 'per_microbatch' supports only full-backward schedules")
        submod = cast(FSDPModule, self.submod)  # _fsdp_per_microbatch: an FSDP stage
        submod.set_is_last_backward(True)
        submod.set_reshard_after_backward(True)
        submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


def reset_step_counters(module: nn.Module) -> None:
    """Modules with a `reset_step_counters()` (models/spec.py) forget what the last pass counted."""
    for m in module.modules():
        reset = getattr(m, "reset_step_counters", None)
        if callable(reset):
            reset()
