"""DiLoCo across torchft replica groups (`fault_tolerance.semi_sync_method = "diloco"`): each group
trains alone (FSDP inside it as usual, no per-step cross-group all-reduce), and at every
`sync_steps`-th step (and the last) the groups average their *pseudo-gradients* (global weights
- local weights) and an outer optimizer, Nesterov SGD (`outer_lr`, `outer_momentum`), steps the
global weights; every group then trains on from the new global weights.

Written here rather than with `torchft.local_sgd.DiLoCo` (torchft-nightly 2026.10.26), because that
class (1) all-reduces the pseudo-gradients in the parameters' dtype or, with `should_quantize`, in
fp8 through triton kernels (CUDA only): the precision plan could not choose float32 or bfloat16
on the wire; (2) keeps the backup ("global") weights in the parameters' dtype and steps its outer
optimizer on the model's parameters, so under pure bf16 training the global weights and the
Nesterov momentum would be bf16; (3) starts the quorum from the inner optimizer's step hooks,
while this loop owns the quorum, healing and discard counters (train/fault_tolerance.py). What is
kept from it: the pseudo-gradient's sign, the outer step on the averaged pseudo-gradient, and the
discard rule below.

Per rank, on this rank's shards (FSDP DTensors' local tensors, or whole parameters): the global
weights and the outer momentum in the plan's outer_state_dtype (float32), one flat pseudo-gradient
buffer per sync cast to the plan's pseudo_gradient_dtype for torchft's all-reduce (one call).

- The model's persistent buffers (MoE's expert biases, which learn outside the optimizer from
  each group's own token counts) are synced with the weights: their pseudo-gradients travel in
  the same all-reduce, and their global copies (fp32) take the groups' mean step whole, no outer
  optimizer (a balancing controller's state, not trained weights): the new global buffers are
  the groups' mean, every group trains on from them.
- A sync is a torchft quorum: a group that is behind (restarted) copies a live group's state
  there (TrainingState: weights, inner AdamW moments, LR, schedule, data position, counters; and
  this module's global weights, outer momentum and sync count), then all-reduces with it. A
  process's first act is such a sync (the *join*): on a fresh job every pseudo-gradient is zero
  and nothing changes; a restarted group heals there and joins the live groups' next sync.
- A discarded sync (a peer died during the all-reduce: `should_commit` is False): the weights go
  back to the last global weights, so the inner steps since the last sync are lost, as
  torchft's DiLoCo does; the step counter, data position and LR schedule go on, and the inner
  AdamW moments keep what those steps added (undoing that would need a second copy of them).
- Checkpoints (checkpoint/parts.py's "diloco" part): the global weights and outer momentum as
  DTensors laid out like the parameters (a DCP load reshards them like the model), the sync count
  and the step of the last sync. Regular saves fall on syncs (checkpoint.interval is a multiple of
  sync_steps), where every group's local weights are the global ones, so the one group's shared
  checkpoint holds every group's model (each group's own inner optimizer state goes into its own
  files: checkpoint/replicas.py). A process that restored them joins without an outer step
  (its join's all-reduce still runs, for the quorum) and trains on from the restored weights: a
  full restart continues as if never stopped. A pre-emption's forced save between syncs holds the
  saving group's local weights mid-interval: every group resumes from those.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_amp.config import JobConfig
from torchtitan_amp.distributed.process_groups import unwrapped_name
from torchtitan_amp.models.spec import persistent_buffers
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.train.fault_tolerance import ReplicaGroups

if TYPE_CHECKING:
    from torchtitan_amp.train.fault_tolerance import FaultTolerance

logger = logging.getLogger("torchtitan_amp")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's shard as a view (updated in place)."""
    return t.to_local() if isinstance(t, DTensor) else t


# Elements per chunk of a sync's work (pseudo-gradient, all-reduce, outer step): the temporaries
# beyond the wire buffer are a few chunks, 64 MiB each in fp32, whatever the shard's size.
CHUNK_ELEMENTS = 1 << 24

Piece = tuple[int, int, int]  # (index of the tensor, start, end) in that tensor's flat view


def chunks(sizes: list[int], chunk: int) -> list[tuple[int, int, list[Piece]]]:
    """The concatenation of tensors of `sizes` elements cut into chunks of `chunk` elements (the
    last shorter): (start, end) in the concatenation and the tensors' pieces each chunk covers."""
    out: list[tuple[int, int, list[Piece]]] = []
    pieces: list[Piece] = []
    start = pos = 0
    for i, n in enumerate(sizes):
        lo = 0
        while lo < n:
            take = min(n - lo, chunk - (pos - start))
            pieces.append((i, lo, lo + take))
            lo, pos = lo + take, pos + take
            if pos - start == chunk:
                out.append((start, pos, pieces))
                pieces, start = [], pos
    if pieces:
        out.append((start, pos, pieces))
    return out


def _flat(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements lo..hi of `t` in order: a view (written in place) of a contiguous tensor."""
    return t.view(-1)[lo:hi] if t.is_contiguous() else t.reshape(-1)[lo:hi]


def pseudo_gradient(
    global_weights: list[torch.Tensor], weights: list[torch.Tensor], wire_dtype: torch.dtype, chunk: int | None = None
) -> torch.Tensor:
    """start - local for every tensor, in one flat buffer of `wire_dtype`, where start is where the
    model began the interval: the global weights as the model holds them (rounded once to the
    parameters' dtype, as the sync copied them in; the global weights themselves when that dtype
    is theirs). Taken against the global weights instead, a bf16 model would send the rounding
    of the global weights back as part of its pseudo-gradient, every sync. Computed in the global
    weights' dtype (float32), then rounded once to `wire_dtype`.

    Args:
        global_weights: the outer (fp32) weights, one per trained tensor.
        weights: the model's local tensors, in the same order.
        wire_dtype: the dtype the pseudo-gradient is all-reduced in.
        chunk: elements converted at a time, bounding the temporaries (None: whole tensors).
    """
    total = sum(g.numel() for g in global_weights)
    state_dtype = global_weights[0].dtype if global_weights else torch.float32
    wire = torch.empty(total, dtype=wire_dtype, device=global_weights[0].device if global_weights else None)
    for start, end, pieces in chunks([g.numel() for g in global_weights], chunk or CHUNK_ELEMENTS):
        direct = wire_dtype == state_dtype  # computed into the wire buffer itself
        out = wire[start:end] if direct else torch.empty(end - start, dtype=state_dtype, device=wire.device)
        offset = 0
        for i, lo, hi in pieces:
            g, w = _flat(global_weights[i], lo, hi), _flat(weights[i], lo, hi)
            began = g if w.dtype == g.dtype else g.to(w.dtype).to(g.dtype)
            torch.sub(began, w, out=out[offset : offset + hi - lo])
            offset += hi - lo
        if not direct:
            wire[start:end].copy_(out)
        del out, began  # before the next chunk's: at most one chunk's temporaries at a time
    return wire


@torch.no_grad()
def mean_step(global_buffers: list[torch.Tensor], mean: torch.Tensor) -> None:
    """The global buffers minus the groups' mean pseudo-gradient (flat, any dtype): the groups'
    mean buffers."""
    offset = 0
    for g in global_buffers:
        g.sub_(mean[offset : offset + g.numel()].view_as(g).to(g.dtype))
        offset += g.numel()


@torch.no_grad()
def outer_step(
    global_weights: list[torch.Tensor],
    momentum: list[torch.Tensor],
    mean: torch.Tensor,
    lr: float,
    mu: float,
    chunk: int | None = None,
) -> None:
    """Nesterov SGD on the global weights, in place: m = mu m + d; g -= lr (d + mu m),
    torch.optim.SGD's nesterov rule with zero dampening, in the state's dtype. Elementwise, so the
    chunking changes no value.

    Args:
        global_weights: the outer weights, updated in place.
        momentum: the outer momentum, one per global weight, updated in place.
        mean: the groups' mean pseudo-gradient d, flat, any dtype (upcast to the state's).
        lr: the outer learning rate.
        mu: the Nesterov momentum.
        chunk: elements upcast at a time (None: whole tensors).
    """
    if not global_weights:  # a rank holding no trained shard still joined the all-reduce
        return
    dtype = global_weights[0].dtype
    for start, end, pieces in chunks([g.numel() for g in global_weights], chunk or CHUNK_ELEMENTS):
        d = mean[start:end].to(dtype)
        deltas, gw, mom, offset = [], [], [], 0
        for i, lo, hi in pieces:
            deltas.append(d[offset : offset + hi - lo])
            gw.append(_flat(global_weights[i], lo, hi))
            mom.append(_flat(momentum[i], lo, hi))
            offset += hi - lo
        torch._foreach_mul_(mom, mu)
        torch._foreach_add_(mom, deltas)
        update = torch._foreach_add(deltas, mom, alpha=mu)
        torch._foreach_add_(gw, update, alpha=-lr)
        del d, deltas, update


class DiLoCo:
    """This rank's global weights and outer momentum, and the sync the loop calls."""

    def __init__(
        self,
        ft: FaultTolerance,
        params: list[nn.Parameter],
        plan: PrecisionPlan,
        outer_lr: float,
        outer_momentum: float,
        names: list[str] | None = None,
        buffers: list[torch.Tensor] | None = None,
    ) -> None:
        """`names`: the parameters' names in the model (checkpoint keys; default their index);
        `buffers`: the model's floating-point persistent buffers, synced by their mean."""
        self.ft, self.plan, self.lr, self.mu = ft, plan, outer_lr, outer_momentum
        self.sync_steps = plan.sync_steps
        trained = [(n, p) for n, p in zip(names or [str(i) for i in range(len(params))], params) if p.requires_grad]
        self.names, self.params = [n for n, _ in trained], [p for _, p in trained]
        # References to the shards (views), updated in place: a healing group copies into them.
        self.weights = [_local(p.detach()) for p in self.params]
        self.global_weights = [
            w.to(plan.outer_state_dtype, copy=True, memory_format=torch.contiguous_format) for w in self.weights
        ]
        self.momentum = [torch.zeros_like(g) for g in self.global_weights]
        self.buffers = list(buffers or [])
        self.global_buffers = [b.to(plan.outer_state_dtype, copy=True) for b in self.buffers]
        self.syncs = 0  # syncs committed (the join of a fresh job included)
        self.inner_steps_lost = 0  # inner steps undone by discarded syncs
        self._last_sync_step, self._last_sync_time = 0, time.perf_counter()
        self.restored = False  # the state came from a checkpoint: the next join takes no outer step
        ft.manager.register_state_dict_fn("diloco", self.load_state_dict, self.state_dict)

    def checkpoint_state(self) -> dict[str, Any]:
        """The checkpoint's "diloco" part: per trained parameter its global weights and momentum
        shaped and placed like it (this rank's shards, as DTensors of the parameter's mesh: DCP
        saves and loads them like the model's), the sync count and the step of the last sync."""
        out: dict[str, Any] = {"syncs": self.syncs, "last_sync_step": self._last_sync_step}
        for name, p, g, m in zip(self.names, self.params, self.global_weights, self.momentum):
            out[f"global.{name}"], out[f"momentum.{name}"] = _placed_like(p, g), _placed_like(p, m)
        return out

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """The "diloco" part loaded (DCP loaded the tensors into checkpoint_state's, which are
        views of this rank's state; copied anyway so any state dict of that form loads)."""
        for name, g, m in zip(self.names, self.global_weights, self.momentum):
            g.copy_(_local(state[f"global.{name}"]))
            m.copy_(_local(state[f"momentum.{name}"]))
        self.syncs, self._last_sync_step = int(state["syncs"]), int(state["last_sync_step"])
        self.restored = True

    @torch.no_grad()
    def after_load(self) -> None:
        """After the checkpoint load (or none): the shards taken again (loading a state dict into
        FSDP2 parameters gives them new local tensors: the old views would be stale), and, unless
        DiLoCo's own state was loaded, global weights = the parameters and momentum 0 (a fresh
        job, an initial model, or 'diloco' in checkpoint.exclude_from_loading)."""
        self.weights = [_local(p.detach()) for p in self.params]
        # Not in the checkpoint: saves fall on syncs, where the buffers are the global ones.
        for g, b in zip(self.global_buffers, self.buffers):
            g.copy_(b)
        if not self.restored:
            torch._foreach_copy_(self.global_weights, self.weights)
            torch._foreach_zero_(self.momentum)

    def state_dict(self) -> dict[str, Any]:
        return {
            "global": self.global_weights,
            "momentum": self.momentum,
            "global_buffers": self.global_buffers,
            "syncs": self.syncs,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (
            ("global", self.global_weights),
            ("momentum", self.momentum),
            ("global_buffers", self.global_buffers),
        ):
            if len(state[key]) != len(mine):
                raise RuntimeError(f"the live group's DiLoCo {key} differ from this group's: another model or layout?")
            for t, theirs in zip(mine, state[key]):
                t.copy_(theirs)
        self.syncs = state["syncs"]

    def due(self, step: int, last_step: int) -> bool:
        """Whether `step` ends with a sync: every sync_steps-th step and the last."""
        return step % self.sync_steps == 0 or step == last_step

    @torch.no_grad()
    def sync(self, counters: Any) -> bool:
        """Quorum (healing first when behind), pseudo-gradient all-reduce, outer step or discard;
        `counters.step` is the step that just ended (0 for the join). True when this group has
        just loaded a live group's state: the caller's data iterator must restart from it."""
        healed = self.ft.start_step()
        # A join after a checkpoint restore, with every group at the same step (no heal): the groups
        # hold that checkpoint's state, which no outer step may change (the uninterrupted run took
        # none here). Its all-reduce still runs: the quorum's groups all take part in each sync.
        resumed, self.restored = self.restored and not healed, False
        if healed:
            self._last_sync_step = counters.step
        wire = pseudo_gradient(
            self.global_weights + self.global_buffers, self.weights + self.buffers, self.plan.pseudo_gradient_dtype
        )
        # One all-reduce per chunk of the wire buffer, all issued before the first is waited on.
        works = [
            self.ft.allreduce("pseudo_gradient", (self.plan.outer_state_dtype,), wire[start:end])
            for start, end, _ in chunks([wire.numel()], CHUNK_ELEMENTS) or [(0, 0, [])]
        ]
        for work in works:
            work.wait()
        # A discarded sync loses the time since the last committed one (ft_lost_s), not only its own.
        committed = self.ft.should_commit(since=self._last_sync_time)
        if committed and resumed:  # the restored weights, global weights and momentum stand
            self._last_sync_time = time.perf_counter()
            return False
        if committed:
            trained = sum(g.numel() for g in self.global_weights)
            outer_step(self.global_weights, self.momentum, wire[:trained], self.lr, self.mu)
            mean_step(self.global_buffers, wire[trained:])
            self.syncs += 1
        else:
            lost = counters.step - self._last_sync_step
            self.inner_steps_lost += lost
            logger.warning(
                "DiLoCo: the sync after step %d was discarded (a replica group failed during it): "
                "back to the global weights of step %d, %d inner steps lost",
                counters.step,
                self._last_sync_step,
                lost,
            )
        # Committed: the new global weights; discarded: the last ones.
        torch._foreach_copy_(self.weights + self.buffers, self.global_weights + self.global_buffers)
        self._last_sync_step, self._last_sync_time = counters.step, time.perf_counter()
        return healed

    def metrics(self) -> dict[str, float]:
        return {"ft_syncs": float(self.syncs), "ft_inner_steps_lost": float(self.inner_steps_lost)}


class DiLoCoReplicas(ReplicaGroups):
    """The loop under DiLoCo: each group steps alone; a sync joins them before the first step
    and after every due step (and the audited one)."""

    def __init__(self, ft: FaultTolerance, diloco: DiLoCo) -> None:
        super().__init__(ft)
        self.diloco = diloco

    def start(self, counters: Any, batches: Iterator[Any]) -> Iterator[Any]:
        """The join; healed by it, the data position is the live group's."""
        return counters.new_batches() if self.diloco.sync(counters) else batches

    def after_step(self, counters: Any, batches: Iterator[Any], last_step: int) -> Iterator[Any]:
        """A due sync after the step; healed by it, step, counters and data are the live group's.
        Returns the batches to go on with.

        Args:
            counters: the training loop (its step counter, new_batches and run).
            batches: the batch iterator the loop is reading.
            last_step: the run's final step, when a sync is due whatever the interval.
        """
        if self.diloco.due(counters.step, last_step) and self.diloco.sync(counters):
            return counters.new_batches()
        return batches

    def audited_step(self, counters: Any, batches: Iterator[Any]) -> None:
        """Followed by a sync (the pseudo-gradient all-reduce)."""
        counters.train_step(batches)
        self.diloco.sync(counters)

    def metrics(self) -> dict[str, float]:
        return {**self.ft.metrics(), **self.diloco.metrics()}


def _placed_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's part of `param`, in any dtype) as a tensor placed like `param`: a
    DTensor of its mesh and placements (a view of `local`), or `local` itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def build(
    config: JobConfig,
    ft: FaultTolerance | None,
    model_parts: list[nn.Module],
    params: list[nn.Parameter],
    plan: PrecisionPlan,
) -> DiLoCo | None:
    """The rank's DiLoCo state under fault_tolerance.semi_sync_method = "diloco", else None.

    Args:
        config: the job config: fault tolerance's sync steps and outer optimizer.
        ft: the replica group's fault tolerance (None: off, and then no DiLoCo).
        model_parts: this rank's model parts, whose names key the checkpoint's state.
        params: the trained parameters, named as in `model_parts`.
        plan: the precision plan: the pseudo-gradient's wire dtype and the outer state's dtype.
    """
    if ft is None or not plan.sync_steps:
        return None
    by_id = {id(p): unwrapped_name(n) for part in model_parts for n, p in part.named_parameters()}
    names = [by_id.get(id(p), str(i)) for i, p in enumerate(params)]
    f = config.fault_tolerance
    buffers = [b for _, b in persistent_buffers(model_parts) if b.is_floating_point()]
    return DiLoCo(ft, params, plan, f.outer_lr, f.outer_momentum, names, buffers)
