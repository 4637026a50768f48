"""What a pipeline rank holds between and inside its microbatch passes, measured in a real run
(tests/workers/dry_run_worker.py records it for tests/test_dry_run.py): per stage, the most
microbatches forwarded and not yet backwarded (the dry run's in-flight count), and the most bytes
of FSDP's unsharded buffers alive at once over all the rank's stages (gathered parameters,
unsharded gradients, accumulated unsharded gradients in the reduce dtype), sampled after every
forward and backward pass of a stage, at every FSDP group's post-backward (before it reduces) and
as every FSDP group copies its gradients into its reduce-scatter input (both counted in)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor

from torchtitan_amp.core.torch_compat import fsdp_param_groups


def _fsdp_params(parts: list[torch.nn.Module]) -> Iterator:  # type: ignore[type-arg]
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                for group in fsdp_param_groups(module._get_fsdp_state()):
                    yield from group.fsdp_params


def unsharded_bytes(parts: list[torch.nn.Module], extra: list[torch.Tensor] = ()) -> dict[str, int]:  # type: ignore[assignment]
    """Bytes of distinct live storages FSDP holds unsharded (and of `extra`), by dtype."""
    seen: set[int] = set()
    out: dict[str, int] = defaultdict(int)

    def add(t: torch.Tensor | None) -> None:
        if t is None:
            return
        if isinstance(t, DTensor):  # EP- or TP-split parameters: this rank's piece
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[str(t.dtype).removeprefix("torch.")] += storage.nbytes()

    for fp in _fsdp_params(parts):
        param = getattr(fp, "_unsharded_param", None)
        add(param)
        add(None if param is None else param.grad)
        add(fp.unsharded_accumulated_grad)
    for t in extra:
        add(t)
    return dict(out)


class PipelineHeld:
    """Installs the counters on a trainer's pipeline; read `in_flight` and `fsdp` after a step."""

    def __init__(self, trainer) -> None:  # type: ignore[no-untyped-def]
        self.parts = trainer.run.model_parts
        self.in_flight: dict[int, int] = defaultdict(int)
        self.fsdp: dict[str, int] = {}
        self._open: dict[int, int] = defaultdict(int)
        self.on = False
        schedule = trainer.run.pipeline.schedule
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            self._wrap(stage)
        original = FSDPParamGroup.post_backward

        def post_backward(group, *args):  # type: ignore[no-untyped-def]
            self.sample()
            return original(group, *args)

        FSDPParamGroup.post_backward = post_backward  # this worker process only
        copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in

        def counted_copy_in(grads, reduce_scatter_input, *args, **kwargs):  # type: ignore[no-untyped-def]
            # The moment a group's unsharded gradients and its reduce-scatter input both exist
            # (its parameters already resharded when reshard_after_backward is on).
            self.sample([*grads, reduce_scatter_input])
            return copy_in(grads, reduce_scatter_input, *args, **kwargs)

        _fsdp_collectives.foreach_reduce_scatter_copy_in = counted_copy_in

    def _wrap(self, stage) -> None:  # type: ignore[no-untyped-def]
        fwd, bwd, sid = stage.forward_one_chunk, stage.backward_one_chunk, stage.stage_index

        def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = fwd(*args, **kwargs)
            if self.on:
                self._open[sid] += 1
                self.in_flight[sid] = max(self.in_flight[sid], self._open[sid])
                self.sample()
            return out

        def backward(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = bwd(*args, **kwargs)
            if self.on:
                self._open[sid] -= 1
                self.sample()
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = forward, backward

    def sample(self, extra: list[torch.Tensor] = ()) -> None:  # type: ignore[assignment]
        if not self.on:
            return
        now = unsharded_bytes(self.parts, extra)
        if sum(now.values()) > sum(self.fsdp.values()):
            self.fsdp = now
