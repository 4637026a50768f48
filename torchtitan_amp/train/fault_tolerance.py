"""Fault tolerance with torchft (`[fault_tolerance]`): this torchrun is one replica group of several.
Inside the group the model is FSDP-sharded (or whole, on a one-rank group) as usual; across the
groups torchft's Manager averages the gradients and decides, per step, which groups take part:

- `start_step` asks the lighthouse for the step's quorum; a group that is behind (restarted) copies
  the training state of a live group over HTTP before its forward (`heal`);
- the cross-group all-reduce runs inside backward (FSDP's all-reduce hook, on each reduce-scatter
  output of the step's last micro-batch) or after it (plain gradients), in the dtype the precision
  plan decides; the step's count of valid labels and the MoE experts' token counts are summed over
  the quorum too, so that every group takes the same step as one process over all their data;
- `should_commit` says whether every group's all-reduce went through: when not (a peer died during
  the step), the step is discarded (no optimizer or LR step) and the next quorum leaves the dead
  group out.

torchft is imported here only, and only when fault_tolerance.enable is on.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan_amp.checkpoint.replicas import ReplicaGroup
from torchtitan_amp.config import ConfigError, FaultToleranceConfig, JobConfig
from torchtitan_amp.config.validation import lighthouse_problem
from torchtitan_amp.core.errors import ReplicaGroupGaveUp
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models.loss import label_weight
from torchtitan_amp.models.spec import persistent_buffers
from torchtitan_amp.precision import PrecisionPlan

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from torchtitan_amp.data.loader import ParallelAwareDataLoader

logger = logging.getLogger("torchtitan_amp")


def data_position(config: JobConfig, dims: ParallelDims, rank: int) -> tuple[int, int]:
    """(data rank, data degree) of `rank`: each replica group reads its own share of the global
    order, as if its data-parallel ranks followed those of the groups before it (torchtitan's
    split). Without fault tolerance, the data-parallel rank and degree.

    Args:
        config: the job config: fault tolerance's replica group id and group count.
        dims: the parallel degrees within a group.
        rank: this rank's global rank within its group.
    """
    ft = config.fault_tolerance
    if not ft.enable:
        return dims.dp_rank(rank), dims.dp_degree
    return ft.replica_id * dims.dp_degree + dims.dp_rank(rank), ft.group_size * dims.dp_degree


def group_config(config: JobConfig) -> JobConfig:
    """The config a replica group runs with: its own outputs (metrics, precision report, traces)
    in `job.dump_folder/replica_<id>`, as torchtitan's metrics are, so that groups launched with
    one dump folder never write the same file; the checkpoint folder stays the job's,
    `job.dump_folder/checkpoint.folder`, shared by the groups (checkpoint/replicas.py). Without
    fault tolerance, `config` itself."""
    ft = config.fault_tolerance
    if not ft.enable:
        return config
    job_folder = Path(config.job.dump_folder)
    group = copy.deepcopy(config)
    group.job.dump_folder = str(job_folder / f"replica_{ft.replica_id}")
    group.checkpoint.folder = str((job_folder / config.checkpoint.folder).absolute())
    return group


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's shard (a view, so the reference stays live)."""
    return t.to_local() if isinstance(t, DTensor) else t


def init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Create the optimizer's per-parameter state before the first step, so that a live group can
    serve it (and a healing one receive it) at any step. A zero-gradient step at lr 0 leaves
    AdamW's weights and moments as they were; its step counters are put back to 0, so the first
    real step is the same as without this. A resumed optimizer (its state loaded from a
    checkpoint) is left as it is: such a step would decay its moments and zero its counters."""
    if all(optimizer.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


# Who is told of every cross-group all-reduce (the precision audit): called with what it carries
# ("gradients": the per-step average; "pseudo_gradient": DiLoCo's sync), the dtypes of the values
# before the wire cast, and the wire tensor itself, before torchft sends it. torchft's
# Manager.allreduce runs on its own process group, out of torch.distributed's (and so of
# observability.traffic's) sight: our call sites are where its dtype can be seen.
WireRecorder = Callable[[str, tuple[torch.dtype, ...], torch.Tensor], None]


# Cap of one cross-group all-reduce bucket of plain gradients: DDP's default bucket_cap_mb.
BUCKET_BYTES = 25 << 20


def grad_buckets(
    grads: list[torch.Tensor], wire_dtype: Callable[[torch.dtype], torch.dtype], cap_bytes: int
) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    """`grads` in order, grouped by (device, wire dtype) into buckets; returns (wire dtype, grads)
    per bucket.

    Args:
        grads: the gradients to all-reduce across the groups.
        wire_dtype: each gradient's dtype -> the dtype it is sent in.
        cap_bytes: a bucket's most bytes on the wire (a larger gradient is a bucket of its own).
    """
    open_buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    used: dict[tuple[torch.device, torch.dtype], int] = {}
    done: list[tuple[torch.dtype, list[torch.Tensor]]] = []
    for g in grads:
        dtype = wire_dtype(g.dtype)
        key, size = (g.device, dtype), g.numel() * dtype.itemsize
        bucket = open_buckets.setdefault(key, [])
        if bucket and used[key] + size > cap_bytes:
            done.append((dtype, bucket))
            bucket = open_buckets[key] = []
        if not bucket:
            used[key] = 0
        bucket.append(g)
        used[key] += size
    return done + [(dtype, bucket) for (_, dtype), bucket in open_buckets.items()]


def _flatten(bucket: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The bucket as one contiguous tensor in the wire dtype; a lone gradient already in it and
    contiguous is all-reduced in place."""
    if len(bucket) == 1 and bucket[0].dtype == dtype and bucket[0].is_contiguous():
        return bucket[0]
    return torch.cat([g.reshape(-1).to(dtype) for g in bucket])


def _unflatten(wire: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    """The averaged bucket back into its gradients (converted to their dtype)."""
    if len(bucket) == 1 and wire is bucket[0]:
        return
    offset = 0
    for g in bucket:
        g.copy_(wire[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class TrainingState:
    """What a healing group copies from a live one: this rank's shards of the weights and of the
    optimizer state, the model's persistent buffers (MoE's expert biases: the model's state dict,
    as torchtitan's heal loads it), the LR, the schedule, the data position and the step counters.

    The tensors are references cached once (shards are updated in place), not a state_dict()
    per request: torchft serves them from its own thread, and FSDP2's state_dict() there, during
    the live group's forward, breaks it."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        dataloader: ParallelAwareDataLoader,
        counters: Any,
    ) -> None:
        self.optimizer, self.lr_scheduler, self.dataloader, self.counters = (
            optimizer,
            lr_scheduler,
            dataloader,
            counters,
        )
        named = [(f"{i}.{n}", p) for i, part in enumerate(model_parts) for n, p in part.named_parameters()]
        self.weights = {n: _local(p.detach()) for n, p in named}
        self.moments = {
            f"{n}/{k}": _local(v)
            for n, p in named
            for k, v in optimizer.state.get(p, {}).items()
            if isinstance(v, torch.Tensor)
        }
        self.buffers = dict(persistent_buffers(model_parts))

    def state_dict(self) -> dict[str, Any]:
        return {
            "weights": self.weights,
            "moments": self.moments,
            "buffers": self.buffers,
            "lr": [g["lr"] for g in self.optimizer.param_groups],
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "data": self.dataloader.state_dict(),
            "step": self.counters.step,
            "tokens_seen": self.counters.tokens_seen,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("weights", "moments", "buffers"):
            mine = getattr(self, key)
            if set(mine) != set(state[key]):
                raise RuntimeError(f"the live group's {key} differ from this group's: another model or layout?")
            for name, t in mine.items():
                t.copy_(state[key][name])
        for g, lr in zip(self.optimizer.param_groups, state["lr"]):
            g["lr"] = lr
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.dataloader.load_state_dict(state["data"])
        self.counters.step, self.counters.tokens_seen = state["step"], state["tokens_seen"]


class FaultTolerance:
    """This group's torchft Manager and what the loop asks of it, with the counters it logs."""

    def __init__(
        self, ft: FaultToleranceConfig, plan: PrecisionPlan, manager: Any = None, device_type: str = "cpu"
    ) -> None:
        """`manager`: torchft's Manager for this group (None: built from `ft` for a job training on
        `device_type`; tests pass a stand-in)."""
        self._store: TCPStore | None = None  # the group's own TCPStore when it runs as one process without torchrun
        self.manager = manager if manager is not None else self._build_manager(ft, device_type)
        self.max_retries = ft.max_retries
        self.plan, self.replica_id = plan, ft.replica_id
        self.recorders: list[WireRecorder] = []
        self.participants = 0  # groups in the current step's quorum
        self.discarded = 0  # steps whose cross-group all-reduce failed (not committed)
        self.heals = 0  # times this group copied the state of a live group
        self.heal_s = 0.0  # seconds the last heal took (quorum + transfer + load)
        self.quorum_s = 0.0  # seconds the last quorum took (a dead group costs its heartbeat timeout)
        self.lost_s = 0.0  # seconds spent in discarded steps, in all
        self._step_start = 0.0
        self.last_discarded = False
        self._healed = False
        # The tensors FSDP's all-reduce hook sent in this backward, held until it has ended
        # (backward_done): see _allreduce_in_place.
        self._in_flight: list[torch.Tensor] = []

    @contextlib.contextmanager
    def recording(self, recorder: WireRecorder) -> Iterator[None]:
        """Inside the block `recorder` is told of every cross-group all-reduce (WireRecorder)."""
        self.recorders.append(recorder)
        try:
            yield
        finally:
            self.recorders.remove(recorder)

    def allreduce(self, kind: str, sources: tuple[torch.dtype, ...], wire: torch.Tensor) -> Any:
        """torchft's average of `wire` over the quorum's groups (in place; returns its work), the
        recorders told first: every cross-group collective of values goes through here (the
        integer counts of sum_across_groups are exact in any case, and not recorded).

        Args:
            kind: the traffic recorders' name for the collective.
            sources: the dtypes of the tensors packed into `wire`, for the recorders.
            wire: the flat buffer to average, in its wire dtype.
        """
        for record in self.recorders:
            record(kind, sources, wire)
        return self.manager.allreduce(wire)

    def sum_across_groups(self, counts: torch.Tensor) -> None:
        """`counts` (an integer tensor: valid labels, tokens per expert) summed over the quorum's
        groups, in place. A group that fails during it fails the step's commit, as a gradient's
        all-reduce does: the step, and whatever was computed from the counts, is discarded."""
        self.manager.allreduce(counts, reduce_op=dist.ReduceOp.SUM).wait()

    def register(self, state: TrainingState) -> None:
        """What this group serves to a healing one, and loads when it heals."""
        self.manager.register_state_dict_fn("training", self._load(state), state.state_dict)

    def _load(self, state: TrainingState) -> Callable[[dict[str, Any]], None]:
        def load(sd: dict[str, Any]) -> None:
            state.load_state_dict(sd)
            self._healed = True

        return load

    def attach(self, model_parts: list[nn.Module]) -> None:
        """Cross-group all-reduce of every FSDP group's reduce-scatter output, inside backward."""
        for part in model_parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_all_reduce_hook(self._allreduce_in_place)

    def _allreduce_in_place(self, grad: torch.Tensor) -> None:
        """FSDP's all-reduce hook: `grad` is a reduce-scatter output, allocated on FSDP's
        reduce-scatter stream and used here on the all-reduce stream, whose wait for torchft's
        all-reduce holds that stream, not the host. FSDP then drops it (it casts a reduce dtype
        other than the parameters' to theirs, or adds it to an accumulated gradient), and the
        caching allocator could hand its block to the next reduce-scatter while the all-reduce
        is still queued on it. torch keeps its own HSDP all-reduce's buffer referenced for that
        reason (FSDPParamGroup._all_reduce_state), not a hook's: so it is kept here, until the
        backward has ended (backward_done), when FSDP's finalize_backward has made the default
        stream, on which every later reduce-scatter waits, wait for the all-reduce stream."""
        dtype = self.plan.cross_group_dtype(grad.dtype)
        wire = grad if dtype == grad.dtype else grad.to(dtype)
        self._in_flight.append(grad)
        if wire is not grad:
            self._in_flight.append(wire)
        self.allreduce("gradients", (grad.dtype,), wire).wait()
        if wire is not grad:
            grad.copy_(wire)

    def backward_done(self) -> None:
        """After a backward: the hook's tensors may go back to the allocator."""
        self._in_flight.clear()

    def allreduce_grads(self, params: list[nn.Parameter]) -> None:
        """Plain gradients (a group without FSDP): averaged across groups after backward, in
        flat buckets of up to BUCKET_BYTES per wire dtype (as DDP's), one collective each rather
        than one per tensor; every bucket's all-reduce is issued before the first is waited on,
        so that they overlap. An average is elementwise: bucketing changes no value."""
        grads = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
        pending = []
        for dtype, bucket in grad_buckets(grads, self.plan.cross_group_dtype, BUCKET_BYTES):
            wire = _flatten(bucket, dtype)
            sources = tuple(sorted({g.dtype for g in bucket}, key=str))
            pending.append((bucket, wire, self.allreduce("gradients", sources, wire)))
        for bucket, wire, work in pending:
            work.wait()
            _unflatten(wire, bucket)

    def replica_group(self) -> ReplicaGroup:
        """This group for the checkpoints: the group ranking first in the step's quorum writes
        the shared checkpoint (checkpoint/replicas.py); torchft gives every rank of a group the
        same rank."""
        return ReplicaGroup(self.replica_id, lambda: self.manager.participating_rank() == 0)

    def start_step(self) -> bool:
        """The step's quorum (healing first when this group is behind). True when this group has
        just loaded a live group's state: the caller's data iterator must restart from it."""
        self._healed = False
        self._step_start = time.perf_counter()
        self.manager.start_quorum()
        self.quorum_s = time.perf_counter() - self._step_start
        self.participants = self.manager.num_participants()
        if self._healed:
            self.heals += 1
            self.heal_s = self.quorum_s
            logger.info(
                "fault tolerance: replica group %d healed from a live group in %.2f s (%d groups)",
                self.replica_id,
                self.heal_s,
                self.participants,
            )
        return self._healed

    def should_commit(self, since: float | None = None) -> bool:
        """Whether every group's all-reduce of this step went through (all ranks of the group
        agree); a step that did not is discarded and counted, with the time lost since `since`
        (time.perf_counter(); default: the step's start)."""
        try:
            commit = self.manager.should_commit()
        except RuntimeError as e:
            if "max_retries" not in str(e):
                raise
            raise ReplicaGroupGaveUp(
                f"replica group {self.replica_id} failed to commit {self.max_retries + 1} steps in a row "
                f"(fault_tolerance.max_retries = {self.max_retries}); restart it to heal from a live group"
            ) from None
        self.last_discarded = not commit
        if not commit:
            self.discarded += 1
            self.lost_s += time.perf_counter() - (self._step_start if since is None else since)
            logger.warning(
                "fault tolerance: step discarded (%d so far): a replica group failed during it", self.discarded
            )
        return commit

    def metrics(self) -> dict[str, float]:
        return {
            "ft_participants": float(self.participants),
            "ft_discarded": float(self.discarded),
            "ft_heals": float(self.heals),
            "ft_heal_s": self.heal_s,
            "ft_quorum_s": self.quorum_s,
            "ft_lost_s": self.lost_s,
        }

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _build_manager(self, ft: FaultToleranceConfig, device_type: str) -> Any:
        """This group's torchft Manager. It meets the group's ranks through torchrun's store
        (MASTER_ADDR/MASTER_PORT); a group of one process started without torchrun gets a store
        of its own here."""
        import torchft

        backend, lighthouse = process_group_backend(ft, device_type), lighthouse_address(ft)
        timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
        pg = (
            torchft.ProcessGroupGloo(timeout=timeout)
            if backend == "gloo"
            else torchft.ProcessGroupNCCL(timeout=timeout)
        )
        where: dict[str, Any] = {}
        if "MASTER_ADDR" not in os.environ:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ConfigError(
                    "fault_tolerance.enable: WORLD_SIZE is set without MASTER_ADDR; launch each "
                    "replica group with torchrun (docs/fault_tolerance.md)"
                )
            from torch.distributed import TCPStore

            store = self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            where = {"store_addr": "127.0.0.1", "store_port": store.port, "rank": 0, "world_size": 1}
        # Synchronous quorum: a healing group loads the live state before its forward, and the live
        # group serves it while its own weights stand still (between its optimizer steps).
        # init_sync off: every group initialises the same weights from training.seed.
        return torchft.Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=ft.min_replica_size,
            use_async_quorum=False,
            replica_id=f"torchtitan_amp_{ft.replica_id}",
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
            lighthouse_addr=lighthouse,
            init_sync=False,
            max_retries=None if ft.max_retries < 0 else ft.max_retries,
            **where,
        )


class ReplicaHooks:
    """What the training loop asks of the other replica groups, at its step's phases and around its
    steps. This base is a job without fault tolerance (one group): every hook is a no-op. A
    trainer's `run.replicas` is one of these (train/build.py picks it); `counters` below is the
    trainer (its `step`, `tokens_seen`, `run`, `train_step` and `new_batches`)."""

    # The in-place sum of an integer tensor over the groups that average this step's gradients
    # (the family's after_backward: MoE's token counts), or None.
    sum_across_groups: Callable[[torch.Tensor], None] | None = None

    def register(self, counters: Any) -> None:
        """Before the first step: what a healing group would copy from this one."""

    def label_weights(self, count: torch.Tensor, grad_mean_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(each valid label's weight, the factor that turns this group's losses into its own mean,
        or None) for the step's `count` of valid labels on this group, whose gradient wrappers
        average over `grad_mean_size` ranks."""
        return label_weight(count, grad_mean_size), None

    def syncs_once(self, part: nn.Module) -> bool:
        """Whether `part` accumulates its micro-batches' gradients locally and reduces them once."""
        return False

    def after_backward(self, params: list[nn.Parameter]) -> None:
        """After the step's last backward, before the family's after_backward."""

    def committed(self) -> bool:
        """After clipping: whether the step's gradients are whole (every group's all-reduce went
        through), so that the optimizer may step."""
        return True

    def start(self, counters: Any, batches: Iterator[Any]) -> Iterator[Any]:
        """Before the loop's first step: the batches to train on."""
        return batches

    def take_step(
        self, counters: Any, batches: Iterator[Any]
    ) -> tuple[Iterator[Any], torch.Tensor, torch.Tensor, float] | None:
        """The loop's step `counters.step`: (the batches to go on with, this rank's loss, the
        gradient norm, the LR it trained with), or None when the run must stop without it."""
        lr = counters.run.lr_scheduler.get_last_lr()[0]
        loss, grad_norm, _ = counters.train_step(batches)
        return batches, loss, grad_norm, lr

    def after_step(self, counters: Any, batches: Iterator[Any], last_step: int) -> Iterator[Any]:
        """After a step the loop counted (its tokens too): the batches to go on with.

        Args:
            counters: the training loop (its step counter, new_batches and run).
            batches: the batch iterator the loop is reading; returned as it is here.
            last_step: the run's final step.
        """
        return batches

    def audited_step(self, counters: Any, batches: Iterator[Any]) -> None:
        """The step the precision audit records: a train step as the loop runs it."""
        counters.train_step(batches)

    def metrics(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        """At the end of the run."""


class ReplicaGroups(ReplicaHooks):
    """A replica group of a fault-tolerant job (`ft`: its torchft Manager and counters)."""

    def __init__(self, ft: FaultTolerance) -> None:
        self.ft = ft

    def register(self, counters: Any) -> None:
        run = counters.run
        init_optimizer_state(run.optimizer, run.params)
        self.ft.register(TrainingState(run.model_parts, run.optimizer, run.lr_scheduler, run.dataloader, counters))

    def metrics(self) -> dict[str, float]:
        return self.ft.metrics()

    def shutdown(self) -> None:
        self.ft.shutdown()


class PerStepReplicas(ReplicaGroups):
    """Per-step fault tolerance: each step starts with the quorum and averages its gradients over
    the quorum's groups; a step some group failed during is discarded and retried."""

    def __init__(self, ft: FaultTolerance) -> None:
        super().__init__(ft)
        self.sum_across_groups = ft.sum_across_groups

    def label_weights(self, count: torch.Tensor, grad_mean_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torchft averages the replica groups' gradients: the count is the quorum's (summed
        across the groups) and the weight is multiplied by the groups, so that the average is the
        mean over every valid label of the quorum, not a mean of the groups' means (which differ
        whenever the groups hold different numbers of valid labels). Each group still logs its own
        mean loss (the factor)."""
        total = count.clone()
        self.ft.sum_across_groups(total)
        weight = label_weight(total, grad_mean_size * self.ft.participants)
        return weight, label_weight(count, grad_mean_size) / weight

    def syncs_once(self, part: nn.Module) -> bool:
        """FSDP accumulates unsharded gradients and reduce-scatters once, in the last micro-batch's
        backward, where torchft's all-reduce hook averages them across the groups."""
        return isinstance(part, FSDPModule)

    def after_backward(self, params: list[nn.Parameter]) -> None:
        self.ft.backward_done()
        self.ft.allreduce_grads(params)

    def committed(self) -> bool:
        return self.ft.should_commit()

    def take_step(
        self, counters: Any, batches: Iterator[Any]
    ) -> tuple[Iterator[Any], torch.Tensor, torch.Tensor, float] | None:
        """The quorum first (healed: the data position is the live group's); a discarded step is
        retried on the next batches by the groups still alive, until one commits or a stop signal
        reaches any rank (every rank of the group discarded it, so every rank polls): then the
        last committed step is saved, and the run stops. A group that keeps failing to commit
        must still obey pre-emption."""
        while True:
            if self.ft.start_step():
                batches = counters.new_batches()
            taken = super().take_step(counters, batches)
            if not self.ft.last_discarded:
                return taken
            checkpointer = counters.run.checkpointer
            if checkpointer.should_stop():
                counters.step -= 1
                checkpointer.maybe_save(counters.step, counters.tokens_seen, force=True)
                return None

    def audited_step(self, counters: Any, batches: Iterator[Any]) -> None:
        """With its quorum first (torchft's all-reduce needs one). Each replica group runs its
        audit, and the quorum waits for fault_tolerance.min_replica_size of them, as training does."""
        self.ft.start_step()
        counters.train_step(batches)


def process_group_backend(ft: FaultToleranceConfig, device_type: str) -> str:
    """The cross-group backend: fault_tolerance.process_group, 'auto' resolved for the training
    device (nccl on CUDA, else gloo). nccl off CUDA is refused in one line."""
    if ft.process_group == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if ft.process_group == "nccl" and device_type != "cuda":
        raise ConfigError(
            f"'fault_tolerance.process_group' = 'nccl' needs CUDA; this job trains on {device_type}: "
            "use 'gloo' or 'auto'"
        )
    return ft.process_group


def lighthouse_address(ft: FaultToleranceConfig) -> str:
    """torchft's lighthouse URL: fault_tolerance.lighthouse (checked when the config was read), else
    TORCHFT_LIGHTHOUSE, checked here: without one torchft fails with a KeyError, and with a bad one
    only after its connect timeout."""
    if ft.lighthouse:
        return ft.lighthouse
    address = os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise ConfigError(
            "fault_tolerance.enable needs torchft's lighthouse: set fault_tolerance.lighthouse or "
            "TORCHFT_LIGHTHOUSE to its URL http://HOST:PORT (docs/fault_tolerance.md)"
        )
    problem = lighthouse_problem(address, "TORCHFT_LIGHTHOUSE")
    if problem:
        raise ConfigError(problem)
    return address


def build(config: JobConfig, plan: PrecisionPlan, device_type: str = "cpu") -> FaultTolerance | None:
    """The group's Manager when fault_tolerance.enable is on (after the group's process group:
    it reads torchrun's store), else None.

    Args:
        config: the job config: the fault_tolerance section.
        plan: the precision plan: the cross-group wire dtypes.
        device_type: the device the job trains on ("cpu", "cuda"): picks the cross-group process
            group's backend.
    """
    ft = config.fault_tolerance
    return FaultTolerance(ft, plan, device_type=device_type) if ft.enable else None
