"""Precision audit: what one real training step computed and sent in, against what the precision
plan promised. `mixed_precision.audit = true` makes train.py run one step of the configured job
(its real layout, precision and data) with recorders on, write `precision_audit.json` and a
table, and exit 1 naming every breach (0 when there is none). Off, nothing here is imported.

Promises checked, each by module name or collective:
- every nn.Linear's forward matmuls run in its compute dtype (the plan's param_dtype for modules
  in mixed_precision.lower_precision_safe_modules, the storage dtype for the others);
- attention (scaled dot product or FlexAttention) runs in param_dtype on the low-precision paths;
  the op each module ran is recorded by name ("attention op");
- modules that declare `computes_in_fp32` (RMSNorm, gpt-oss's sink attention) compute every op,
  matmuls included, in fp32 (their input and output casts aside);
- the loss's log-softmax takes fp32 logits;
- backward matmuls run only in param_dtype or the storage dtype;
- parameters, gradients and optimizer state are stored in the storage dtype;
- gradient reductions over the data-parallel dimensions (DDP's compress hook, FSDP's
  reduce-scatter, HSDP's all-reduce) move only reduce_dtype and, for the fp32 modules, the
  storage dtype; FSDP all-gathers only param_dtype and the storage dtype (under context
  parallel FSDP shards over dp_shard x cp: the flattened "dp_shard_cp" dim; under expert
  parallel the routed experts over "efsdp");
- context parallel: keys and values are all-gathered over "cp" in their attention's activation
  dtype (integers, if a caller gathers document ids), their gradients reduce-scattered over "cp"
  in the plan's cp_reduce_dtype, and both are seen at all;
- block-scaled (mixed_precision.block_scaled): every Linear the plan converts, and with
  block_scaled_experts every routed experts module's w1, w2 and w3 GEMMs, ran forward, dgrad and
  wgrad with the recipe's operands (element and scale dtypes, block shape, rounding, RHT:
  lowbit/linear.py's GemmRecords), and the Linears and experts kept out ran none (their
  matmuls are checked in their compute dtype above). The emulated GEMMs themselves are fp32 mms;
- expert parallel: the token rows dispatched to the experts' ranks and combined back (and their
  gradients, the same exchange in reverse) cross "ep" by all-to-all in the plan's dispatch dtype
  only (the counts before them as integers), on no other group, and are seen at all where this
  rank holds an expert-parallel layer;
- fault tolerance (torchft replica groups): every cross-group all-reduce (torchft's Manager, on
  its own process group, recorded where train/fault_tolerance.py calls it) moves the plan's
  dtype: per-step gradient averages (FSDP's all-reduce hook or the one-rank buckets) in
  cross_group_dtype of the gradients' dtype, DiLoCo's pseudo-gradient in pseudo_gradient_dtype;
  the one the method promises is seen at all (the audited step runs its quorum, or a DiLoCo sync),
  the other never.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_amp.core.rules import dtype_name
from torchtitan_amp.distributed import context_parallel
from torchtitan_amp.distributed.process_groups import local_tensor as _local
from torchtitan_amp.distributed.process_groups import unwrapped_name
from torchtitan_amp.models.moe.moe import GroupedExperts
from torchtitan_amp.observability import traffic
from torchtitan_amp.precision import block_scaled, lora
from torchtitan_amp.precision.lowbit import torchao_kernels
from torchtitan_amp.precision.lowbit.linear import GemmRecord, observe_gemms
from torchtitan_amp.precision.plan import PrecisionPlan
from torchtitan_amp.precision.report import expert_parallel_summary

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

logger = logging.getLogger("torchtitan_amp")

_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "_grouped_mm"})
_FP8 = ("float8_e4m3fn", "float8_e5m2")
# Inside an fp32 module these only move data between dtypes; every other op must compute in fp32.
_CASTS = frozenset({"_to_copy", "to", "copy_", "detach", "view", "_unsafe_view", "alias", "t", "expand"})
_DP_DIMS = ("dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp", "efsdp")
_CP_KV = "K/V gradient reduce_scatter:cp"  # the breach naming a cp gradient sum in another dtype
_EP_A2A = "all_to_all:ep"
# EP's exchanges as the dispatcher sees them, forward and backward alike (the backward all-to-all
# runs in C++ autograd, out of traffic's Python wrappers' sight): the rows (functional collective,
# group by name) and the per-expert counts before them (c10d, group as a boxed ProcessGroup).
_ALL_TO_ALLS = {"all_to_all_single": 0, "alltoall_base_": 1}  # op -> index of the tensor sent
# The attention ops by the name the audit reports, SDPA's fused kernels aside (all
# "scaled_dot_product_attention"): FlexAttention, and SDPA's math path, which decomposes (its
# matmuls seen as forward matmuls) around a softmax only it calls (MLA's narrower values on CPU).
_ATTENTION_OPS = {"flex_attention": "flex_attention", "_safe_softmax": "scaled_dot_product_attention"}


@dataclass
class Breach:
    what: str  # e.g. "layers.0.attention.wq: forward matmul"
    promised: list[str]
    seen: list[str]

    def __str__(self) -> str:
        return f"{self.what}: promised {'/'.join(self.promised)}, saw {'/'.join(self.seen)}"


@dataclass
class AuditResult:
    breaches: list[Breach]
    modules: dict[str, dict[str, list[str]]]  # module -> "forward matmul" etc. -> dtypes
    tensors: dict[str, list[str]]  # params / grads / optimizer state -> dtypes
    collectives: dict[str, dict[str, int]]  # "reduce_scatter:dp_shard" -> dtype -> bytes
    backward_matmuls: list[str] = field(default_factory=list)
    gemms: dict[str, dict[str, list[Any]]] = field(default_factory=dict)  # block-scaled: module -> pass -> operands
    # fault tolerance: "gradients" / "pseudo_gradient" -> dtypes of the values sent ("+"-joined for
    # a bucket of several) -> the wire dtypes they were sent in
    cross_group: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.breaches

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "breaches": [asdict(b) for b in self.breaches],
            "modules": self.modules,
            "backward_matmuls": self.backward_matmuls,
            "tensors": self.tensors,
            "collectives": self.collectives,
            "block_scaled_gemms": self.gemms,
            "cross_group_allreduce": self.cross_group,
        }


def _clean(name: str) -> str:
    return unwrapped_name(name) or "<model>"


def _dtype_computed(t: torch.Tensor) -> str:
    """The dtype a matmul actually reads: torchao's Float8TrainingTensor reports its original
    (high-precision) dtype and keeps the float8 payload in `_data`; its own dispatch then runs
    torch._scaled_mm out of this mode's sight. Under TP it sits inside a DTensor."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    data = getattr(t, "_data", None) if type(t) is not torch.Tensor else None
    return dtype_name(data.dtype if isinstance(data, torch.Tensor) else t.dtype)


class _Recorder(TorchDispatchMode):
    """Float input dtypes of the ops that matter, by the innermost module running them, and which
    attention op each module ran ("attention op": SDPA or FlexAttention, a higher-order op that
    reaches a mode only where the mode says it takes them)."""

    supports_higher_order_operators = True

    def __init__(self, fp32_modules: set[str]) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.fp32_modules = fp32_modules
        self.seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.backward_matmuls: set[str] = set()
        self.all_to_all: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def _record_all_to_all(self, name: str, args: tuple) -> None:
        sent = args[_ALL_TO_ALLS[name]]
        group = args[3] if name == "all_to_all_single" else dist.ProcessGroup.unbox(args[2])
        self.all_to_all[_categorize("all_to_all", group)][dtype_name(sent.dtype)] += sent.numel() * sent.element_size()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # Higher-order ops (FlexAttention's forward and backward) have no overload packet.
        name = func.name() if isinstance(func, torch._ops.HigherOrderOperator) else func.overloadpacket.__name__
        if name in _ALL_TO_ALLS:
            self._record_all_to_all(name, args)
        dtypes = {_dtype_computed(a) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        backward = torch._C._current_autograd_node() is not None
        module = self.stack[-1] if self.stack else "<model>"
        if backward:
            if name in _MATMULS:
                self.backward_matmuls |= dtypes
        elif name in _MATMULS:
            self.seen[module]["forward matmul"] |= dtypes
        elif name.startswith("_scaled_dot_product") or name in _ATTENTION_OPS:
            if name != "_safe_softmax":  # the math path's inputs are its matmuls'
                self.seen[module]["attention"] |= dtypes
            self.seen[module]["attention op"].add(_ATTENTION_OPS.get(name, "scaled_dot_product_attention"))
        elif name in ("_log_softmax", "log_softmax"):
            self.seen["<loss>"]["log_softmax"] |= dtypes
        elif module in self.fp32_modules and name not in _CASTS and dtypes:
            self.seen[module]["compute"] |= dtypes
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _module_stack(parts: list[nn.Module], recorder: _Recorder) -> Iterator[None]:
    def enter(name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            recorder.stack.append(name)

        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # returns None: output unchanged
        """The forward hook closing a module: its name leaves the stack.

        Args:
            module: the module whose forward ended (unused: the stack knows its name).
            args: its positional inputs (unused).
            output: its output (unused; returning None keeps it).
        """
        recorder.stack.pop()

    handles = []
    for part in parts:
        for name, module in part.named_modules():
            handles.append(module.register_forward_pre_hook(enter(_clean(name))))
            handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(mesh.get_group())))


def _group_dims(dims: Any) -> dict[tuple[int, ...], str]:
    """Ranks of each mesh dimension's process group -> its name (groups are compared by ranks).
    Under context parallel also the flattened dims: "dp_cp" (the loss's ranks) and "dp_shard_cp"
    (FSDP's), named in that order so that FSDP's name wins where they hold the same ranks (no
    dp_replicate; with cp alone the cp group too: context_parallel's own collectives are told
    apart by where they are called from, `_cp_collectives`). Under expert parallel also "efsdp",
    the group FSDP shards the routed experts over (a data-parallel dim: their gradients are
    reduced there), named first so that a dense dim holding the same ranks keeps its name. The
    ep group is not named here but kept apart (`_EP_RANKS`, set by Auditor.run): all-to-alls on
    its ranks are EP's, whichever dense dim holds the same ranks."""
    if not dist.is_initialized() or dims.world_size == 1:
        return {}
    out = {}
    if dims.ep > 1 and dims.efsdp > 1:
        efsdp = dims.get_mesh("expert_fsdp")
        out[_mesh_ranks(efsdp["efsdp"] if efsdp.ndim > 1 else efsdp)] = "efsdp"
    for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        if getattr(dims, dim) > 1:
            out[_mesh_ranks(dims.mesh[dim])] = dim
    if dims.cp > 1:
        out[_mesh_ranks(dims.get_mesh("loss"))] = "dp_cp"
        fsdp = dims.get_mesh("fsdp")
        out[_mesh_ranks(fsdp["dp_shard_cp"] if fsdp.ndim > 1 else fsdp)] = "dp_shard_cp"
    return out


_GROUP_DIMS: dict[tuple[int, ...], str] = {}
_EP_RANKS: list[tuple[int, ...]] = []  # this rank's expert-parallel group, when ep > 1
_ON_CP = [False]  # inside context_parallel's K/V all-gather or its gradients' reduce-scatter


def _categorize(op: str, group: Any) -> str:
    if _ON_CP[0]:
        return f"{op}:cp"
    try:
        pg = dist.distributed_c10d._resolve_process_group(cast("GroupName", traffic.group_name(group)))
        ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
    except (RuntimeError, ValueError, KeyError):
        ranks = ()
    if op == "all_to_all" and _EP_RANKS and ranks == _EP_RANKS[0]:
        return _EP_A2A
    return f"{op}:{_GROUP_DIMS.get(ranks, 'other')}"


def _cp_collectives() -> contextlib.AbstractContextManager:
    """Label context_parallel's collectives (through its seam) as category "cp": its group may be
    the very group FSDP shards over (cp alone: both are the world), so the group cannot tell."""

    def on_cp(collective: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            _ON_CP[0] = True
            try:
                return collective(*args, **kwargs)
            finally:
                _ON_CP[0] = False

        return call

    return context_parallel.wrapped_collectives(on_cp)


def check_context_parallel(collectives: dict[str, dict[str, int]], cp_reduce: str, kv_dtypes: set[str]) -> list[Breach]:
    """The cp collectives of one step against the plan: K/V (floats) gathered in the promised
    dtypes (integers too: positions, document ids), their gradients summed in `cp_reduce` only;
    neither missing (call it with cp > 1). Returns the breaches, none when all hold.

    Args:
        collectives: the step's bytes by collective category ("all_gather:cp", ...) and dtype name.
        cp_reduce: the dtype name the K/V gradients must be reduce-scattered in (the plan's
            cp_reduce_dtype).
        kv_dtypes: the dtype names keys and values may be all-gathered in (their attention's
            activation dtypes).
    """
    breaches = []
    gathered = collectives.get("all_gather:cp", {})
    floats = sorted(d for d in gathered if torch.is_floating_point(torch.empty(0, dtype=getattr(torch, d))))
    if not floats or not set(floats) <= kv_dtypes:
        breaches.append(Breach("K/V all_gather:cp", sorted(kv_dtypes), floats or ["none seen"]))
    summed = sorted(collectives.get("reduce_scatter:cp", {}))
    if summed != [cp_reduce]:
        breaches.append(Breach(_CP_KV, [cp_reduce], summed or ["none seen"]))
    breaches += [
        Breach(f"context-parallel {c}", ["all_gather:cp", "reduce_scatter:cp"], sorted(d))
        for c, d in collectives.items()
        if c.endswith(":cp") and c not in ("all_gather:cp", "reduce_scatter:cp")
    ]
    return breaches


def check_expert_parallel(collectives: dict[str, dict[str, int]], dispatch: str, holds_experts: bool) -> list[Breach]:
    """EP's all-to-alls of one step against the plan: token rows (floats) only in `dispatch`, the
    counts as integers, nothing on another group, and something seen where this rank holds an
    expert-parallel layer. Returns the breaches, none when all hold.

    Args:
        collectives: the step's bytes by collective category ("all_to_all:ep", ...) and dtype name.
        dispatch: the dtype name tokens must be dispatched and combined in; "none" when the plan
            has no expert parallel (then any float all-to-all is a breach).
        holds_experts: whether this rank holds an expert-parallel layer (it must see the tokens).
    """
    floats = sorted(
        d for d in collectives.get(_EP_A2A, {}) if torch.empty(0, dtype=getattr(torch, d)).is_floating_point()
    )
    breaches = []
    if floats and floats != [dispatch] or holds_experts and not floats:
        breaches.append(Breach(f"expert-parallel token {_EP_A2A}", [dispatch], floats or ["none seen"]))
    breaches += [
        Breach(f"expert-parallel {c}", [_EP_A2A], sorted(d))
        for c, d in collectives.items()
        if c.startswith("all_to_all:") and c != _EP_A2A
    ]
    return breaches


# torchft's cross-group all-reduces, by the kind train/fault_tolerance.py tells its recorders.
CROSS_GROUP = {
    "gradients": "gradient all_reduce:replica_groups",
    "pseudo_gradient": "pseudo-gradient all_reduce:replica_groups",
}


class CrossGroupWires:
    """A recorder of torchft's cross-group all-reduces (fault_tolerance.WireRecorder): per kind,
    the dtypes of the values sent -> the wire dtypes, and the bytes per wire dtype."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def __call__(self, kind: str, sources: tuple[torch.dtype, ...], wire: torch.Tensor) -> None:
        source = "+".join(sorted(dtype_name(d) for d in sources))
        self.seen[kind][source].add(dtype_name(wire.dtype))
        self.bytes[CROSS_GROUP.get(kind, kind)][dtype_name(wire.dtype)] += wire.numel() * wire.element_size()

    def result(self) -> dict[str, dict[str, list[str]]]:
        return {k: {s: sorted(w) for s, w in by.items()} for k, by in self.seen.items()}


def check_cross_group(seen: dict[str, dict[str, list[str]]], plan: PrecisionPlan, sends: bool) -> list[Breach]:
    """torchft's cross-group all-reduces of one audited step against the plan: under DiLoCo
    (plan.sync_steps) the pseudo-gradient in pseudo_gradient_dtype, else each gradient dtype in
    cross_group_dtype of it; the other kind never, and the promised one seen where this rank
    sends. Without fault tolerance, none. Returns the breaches.

    Args:
        seen: per kind ("gradients", "pseudo_gradient"), the dtype of the values sent -> the wire
            dtypes seen (CrossGroupWires.result).
        plan: the precision plan the step ran under.
        sends: whether this rank holds trained parameters (and so must send something).
    """
    if not plan.replica_groups:
        return [
            Breach(
                CROSS_GROUP.get(k, k),
                ["none (fault_tolerance.enable = false)"],
                sorted({w for ws in by.values() for w in ws}),
            )
            for k, by in seen.items()
        ]
    kind = "pseudo_gradient" if plan.sync_steps else "gradients"
    method = "diloco" if plan.sync_steps else "none"
    breaches = [
        Breach(
            CROSS_GROUP.get(k, k),
            [f"none (semi_sync_method = '{method}')"],
            sorted({w for ws in by.values() for w in ws}),
        )
        for k, by in seen.items()
        if k != kind
    ]

    def promised(source: str) -> set[str]:
        if plan.sync_steps:
            return {dtype_name(plan.pseudo_gradient_dtype)}
        return {dtype_name(plan.cross_group_dtype(getattr(torch, d))) for d in source.split("+")}

    by_source = seen.get(kind, {})
    if sends and not by_source:
        every = sorted(promised(dtype_name(plan.reduce_dtype)) | promised(dtype_name(plan.storage_dtype)))
        breaches.append(Breach(CROSS_GROUP[kind], every, ["none seen"]))
    for source, wires in sorted(by_source.items()):
        if set(wires) != promised(source):
            breaches.append(Breach(f"{CROSS_GROUP[kind]} of {source} values", sorted(promised(source)), wires))
    return breaches


class Auditor:
    """Records one train step and checks it against the precision plan.

    Args:
        plan: the precision plan the step promises to keep.
        model_parts: this rank's model parts (pipeline stages), which the step trains.
        dims: the job's parallel dims (the groups its collectives are categorised by).
        optimizer: the step's optimizer, whose state holds `params`' moments.
        params: the parameters the optimizer updates.
        n_layers: the model's layer count (block-scaled edge layers are counted from it).
        cross_group: the replica group's FaultTolerance (its cross-group all-reduces are
            recorded through its `recording`), or None without fault tolerance.
    """

    def __init__(
        self,
        plan: PrecisionPlan,
        model_parts: list[nn.Module],
        dims: Any,
        *,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
        n_layers: int,
        cross_group: Any = None,
    ) -> None:
        self.plan, self.model_parts, self.dims = plan, model_parts, dims
        self.optimizer, self.params, self.n_layers, self.cross_group = optimizer, params, n_layers, cross_group
        self.named = {_clean(n): m for part in model_parts for n, m in part.named_modules()}

    def run(self, step: Callable[[], None]) -> AuditResult:
        """`step()` (one train step as the loop runs it) recorded, gathered over ranks and checked."""
        fp32 = {n for n, m in self.named.items() if getattr(m, "computes_in_fp32", False)}
        recorder = _Recorder(fp32)
        if not traffic.is_installed():
            traffic.install(_categorize, point_to_point=True, functional=True)
        _GROUP_DIMS.clear()
        _GROUP_DIMS.update(_group_dims(self.dims))
        _EP_RANKS[:] = [_mesh_ranks(self.dims.get_mesh("ep"))] if self.dims.ep > 1 else []
        gemms: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))

        def on_gemm(record: GemmRecord) -> None:
            module, what, operands = block_scaled.operand_seen(record)
            if operands not in gemms[_clean(module)][what]:
                gemms[_clean(module)][what].append(operands)

        wires = CrossGroupWires()
        ft = self.cross_group
        with (
            _module_stack(self.model_parts, recorder),
            _cp_collectives(),
            traffic.counting(),
            recorder,
            observe_gemms(on_gemm),
            ft.recording(wires) if ft is not None else contextlib.nullcontext(),
        ):
            step()
        collectives = traffic.snapshot()
        collectives.update({c: dict(d) for c, d in wires.bytes.items()})
        for category, by_dtype in recorder.all_to_all.items():
            collectives[category] = dict(by_dtype)
        modules = {m: {k: sorted(v) for k, v in ops.items()} for m, ops in recorder.seen.items()}
        modules = self._gather(modules)
        backward = sorted(set().union(*self._gather_list(sorted(recorder.backward_matmuls))))
        tensors = self._gather_tensors()
        result = AuditResult([], modules, tensors, collectives, backward, self._gather_gemms(gemms), wires.result())
        result.breaches = self.check(result)
        return result

    # -- collected over ranks: a breach on any rank is a breach ------------------------------

    def _gather_list(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _gather(self, modules: dict[str, dict[str, list[str]]]) -> dict[str, dict[str, list[str]]]:
        merged: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        for rank_modules in self._gather_list(modules):
            for m, ops in rank_modules.items():
                for k, v in ops.items():
                    merged[m][k] |= set(v)
        return {m: {k: sorted(v) for k, v in ops.items()} for m, ops in sorted(merged.items())}

    def _gather_gemms(self, gemms: dict[str, dict[str, list[Any]]]) -> dict[str, dict[str, list[Any]]]:
        merged: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
        for rank in self._gather_list({m: dict(p) for m, p in gemms.items()}):
            for m, passes in rank.items():
                for what, ops in passes.items():
                    merged[m][what] += [o for o in ops if o not in merged[m][what]]
        return {m: dict(p) for m, p in sorted(merged.items())}

    def _check_block_scaled(self, gemms: dict[str, dict[str, list[Any]]]) -> list[Breach]:
        """The plan's block-scaled Linears on this job's ranks against the GEMMs they ran."""
        plan = self.plan
        if plan.block_scaled is None:
            return [
                Breach(f"{m}: block-scaled GEMMs", ["none (mixed_precision.block_scaled = 'none')"], sorted(p))
                for m, p in gemms.items()
            ]
        skip = block_scaled.skip_patterns(plan.block_scaled_skip, plan.block_scaled_edge_layers, self.n_layers)
        linears = {n: m for n, m in self.named.items() if isinstance(m, nn.Linear)}
        promised = {n for n, m in linears.items() if block_scaled.is_block_scaled_linear(n, m, plan.block_scaled, skip)}
        kept_out = set(linears) - promised
        # Grouped experts: promised by the plan's rule, whatever the module holds (one whose
        # block-scaled GEMMs were lost runs the plain grouped matmul and is named here).
        for n, m in self.named.items():
            if isinstance(m, GroupedExperts):
                labels = set(block_scaled.expert_gemm_labels(n))
                chosen = block_scaled.is_block_scaled_experts(n, m, plan.block_scaled, skip, plan.block_scaled_experts)
                (promised if chosen else kept_out).update(labels)
        if not plan.block_scaled_emulated:
            # torchao's kernels quantize inside their own autograd functions, out of the recorder's
            # sight: the audit checks the module each promised Linear became (type and settings),
            # and that no emulated GEMM ran (grouped experts are not converted on this path).
            mine = promised & set(linears)
            return [
                Breach(*b)
                for b in torchao_kernels.check_modules(linears, mine, set(linears) - mine, plan.block_scaled)
                + [(f"{m}: block-scaled GEMMs", ["none (torchao kernels)"], sorted(p)) for m, p in gemms.items()]
            ]
        return [Breach(*b) for b in block_scaled.check_gemms(gemms, promised, kept_out, plan.block_scaled)]

    def _gather_tensors(self) -> dict[str, list[str]]:
        params = self.params
        state = [
            v for p in params for k, v in self.optimizer.state[p].items() if k != "step" and isinstance(v, torch.Tensor)
        ]
        mine = {
            "parameters": sorted({dtype_name(_local(p).dtype) for p in params}),
            "gradients": sorted({dtype_name(_local(p.grad).dtype) for p in params if p.grad is not None}),
            "optimizer_state": sorted({dtype_name(_local(v).dtype) for v in state}),
        }
        merged: dict[str, set[str]] = defaultdict(set)
        for rank in self._gather_list(mine):
            for k, v in rank.items():
                merged[k] |= set(v)
        return {k: sorted(v) for k, v in merged.items()}

    # -- the promises -------------------------------------------------------------------------

    def check(self, r: AuditResult) -> list[Breach]:
        plan, storage = self.plan, dtype_name(self.plan.storage_dtype)
        low = dtype_name(plan.param_dtype) if plan.path != "full" else storage
        breaches: list[Breach] = []

        def expect(what: str, promised: set[str], seen: list[str]) -> None:
            """A breach when something was seen outside what was promised.

            Args:
                what: the breach's subject, as the table names it.
                promised: the dtype names the plan allows.
                seen: the dtype names recorded (none seen is no breach here).
            """
            if seen and not set(seen) <= promised:
                breaches.append(Breach(what, sorted(promised), seen))

        for name, ops in r.modules.items():
            module = self.named.get(name)
            # Linears, MoE routers (router_dtype) and grouped experts (Linears in another form).
            if module is not None and (
                isinstance(module, nn.Linear) or plan.routes(module) or getattr(module, "safe_as", None)
            ):
                expect(
                    f"{name}: forward matmul", {dtype_name(plan.compute_dtype(module))}, ops.get("forward matmul", [])
                )
            if "attention" in ops:
                expect(f"{name}: attention", {low}, ops["attention"])
            if "compute" in ops:
                expect(f"{name}: computes_in_fp32 module", {"float32"}, ops["compute"])
            if getattr(module, "computes_in_fp32", False) and "forward matmul" in ops:  # gpt-oss's sink attention
                expect(f"{name}: computes_in_fp32 module matmul", {"float32"}, ops["forward matmul"])
        expect("loss: log_softmax input", {"float32"}, r.modules.get("<loss>", {}).get("log_softmax", []))
        routed = {dtype_name(plan.router_dtype)} if any(plan.routes(m) for m in self.named.values()) else set()
        emulated = {"float32"} if plan.block_scaled is not None else set()  # the emulation's fp32 GEMMs
        expect(
            "backward matmuls",
            {low, storage, *routed, *emulated, *(_FP8 if plan.fp8 != "none" else ())},
            r.backward_matmuls,
        )
        breaches += self._check_block_scaled(r.gemms)
        for kind in ("parameters", "gradients", "optimizer_state"):
            expect(kind, {storage}, r.tensors.get(kind, []))
        breaches += self._check_gradient_reductions(r.collectives)
        breaches += self._check_lora()
        sends = any(p.requires_grad for p in self.params)
        breaches += check_cross_group(r.cross_group, plan, sends)
        for category, by_dtype in r.collectives.items():
            op, _, dim = category.partition(":")
            if op == "all_gather" and dim in _DP_DIMS:
                fp8_gather = {"float8_e4m3fn", "uint8"} if plan.fp8_all_gather else set()
                expect(f"parameter {category}", {low, storage, *fp8_gather}, sorted(by_dtype))
        if self.dims.cp > 1:
            breaches += check_context_parallel(r.collectives, dtype_name(plan.cp_reduce_dtype), self._kv_dtypes(low))
        ep = expert_parallel_summary(plan)
        if ep is not None or any(c.startswith("all_to_all:") for c in r.collectives):
            holds = any(getattr(m, "expert_parallel", None) is not None for m in self.named.values())
            breaches += check_expert_parallel(r.collectives, ep["dispatch_dtype"] if ep else "none", holds)
        return breaches

    def _check_lora(self) -> list[Breach]:
        """[lora]: the adapters' gradients are fp32 (adapter_dtype) and no base parameter has one,
        on every rank."""
        if self.plan.lora is None:
            return []
        merged: dict[str, set[str]] = defaultdict(set)
        for rank in self._gather_list(lora.audit(self.plan, self.model_parts)):
            for k, v in rank.items():
                merged[k] |= set(v)
        breaches = []
        want = dtype_name(self.plan.lora.adapter_dtype)
        if merged["adapter gradients"] - {want}:
            breaches.append(Breach("lora: adapter gradients", [want], sorted(merged["adapter gradients"])))
        if merged["base parameters with a gradient"]:
            breaches.append(
                Breach("lora: frozen base gradients", ["none"], sorted(merged["base parameters with a gradient"]))
            )
        return breaches

    def _kv_dtypes(self, low: str) -> set[str]:
        """What keys and values are in when gathered: the output dtype of their attention's Linears
        (its compute dtype; fp8 Linears return the low-precision dtype). Attentions are the
        innermost modules the cp group was handed to (parallelize.apply_cp)."""
        holders = [m for m in self.named.values() if getattr(m, "context_parallel", None) is not None]
        inner = [m for m in holders if not any(o is not m and o in holders for o in m.modules())]
        out = {
            dtype_name(self.plan.compute_dtype(lin)) for m in inner for lin in m.modules() if isinstance(lin, nn.Linear)
        }
        return {low if d in _FP8 else d for d in out} or {low}

    def _check_gradient_reductions(self, collectives: dict[str, dict[str, int]]) -> list[Breach]:
        """reduce_dtype carries the lower-precision-safe modules' gradients; the storage dtype only
        the other modules' (bounded by their gradient bytes, plus scalars and FSDP padding)."""
        plan, storage = self.plan, dtype_name(self.plan.storage_dtype)
        reduce = dtype_name(plan.reduce_dtype)
        # Integer reductions over the data-parallel ranks are counts, never gradients: the step's
        # valid labels (loss normalisation) and MoE's tokens per expert.
        reductions = {
            c: {dt: n for dt, n in d.items() if not dt.startswith(("int", "uint"))}
            for c, d in collectives.items()
            if c.partition(":")[0] in ("reduce_scatter", "all_reduce") and c.partition(":")[2] in _DP_DIMS
        }
        reductions = {c: d for c, d in reductions.items() if d}
        # Without a compress hook DDP all-reduces in C++, out of sight: nothing to check there.
        visible = plan.path == "fsdp" or plan.comm_hook != "none"
        dims = self.dims
        if plan.path == "full" or reduce == storage or not visible or dims.dp_replicate * dims.fsdp_shard == 1:
            return [
                Breach(f"gradient {c}", sorted({reduce, storage}), sorted(d))
                for c, d in reductions.items()
                if not set(d) <= {reduce, storage}
            ]
        safe_numel, other_numel = self._numel_by_safety()
        bound = int(other_numel * self.plan.storage_dtype.itemsize * 1.05) + 4096
        breaches = []
        for c, d in reductions.items():
            if not set(d) <= {reduce, storage}:
                breaches.append(Breach(f"gradient {c}", sorted({reduce, storage}), sorted(d)))
            if d.get(storage, 0) > bound:
                breaches.append(
                    Breach(f"gradient {c}: {storage} bytes", [f"<= {bound:,} (fp32 modules only)"], [f"{d[storage]:,}"])
                )
        if safe_numel and not any(d.get(reduce) for d in reductions.values()):
            seen = sorted({dt for d in reductions.values() for dt in d}) or ["no gradient reduction"]
            breaches.append(Breach("gradient reduction of lower-precision-safe modules", [reduce], seen))
        return breaches

    def _numel_by_safety(self) -> tuple[int, int]:
        safe = other = 0
        for module in self.named.values():
            n = sum(p.numel() for p in module.parameters(recurse=False))
            if self.plan.is_safe(module):
                safe += n
            else:
                other += n
        return safe, other


def table(result: AuditResult) -> str:
    lines = [f"precision audit: {'PASS' if result.ok else f'{len(result.breaches)} breach(es)'}"]
    lines += [f"  BREACH {b}" for b in result.breaches]
    for name, ops in result.modules.items():
        lines.append(f"  {name:<40} " + "; ".join(f"{k} {'/'.join(v)}" for k, v in ops.items()))
    lines.append(f"  {'backward matmuls':<40} {'/'.join(result.backward_matmuls)}")
    for k, v in result.tensors.items():
        lines.append(f"  {k:<40} {'/'.join(v)}")
    for category, by_dtype in sorted(result.collectives.items()):
        lines.append(f"  {category:<40} " + ", ".join(f"{d} {n:,} B" for d, n in sorted(by_dtype.items())))
    return "\n".join(lines)


def write(result: AuditResult, dump_folder: str) -> Path:
    path = Path(dump_folder) / "precision_audit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return path


def audit_step(auditor: Auditor, step: Callable[[], None], dump_folder: str, is_logging_rank: bool) -> AuditResult:
    """`mixed_precision.audit`: one train step recorded and checked; the logging rank writes
    precision_audit.json and logs the table. Returns the audit's result.

    Args:
        auditor: records the step and checks it against the plan.
        step: runs one train step.
        dump_folder: the job's output folder, where precision_audit.json goes.
        is_logging_rank: whether this rank writes the file and logs the table.
    """
    result = auditor.run(step)
    if is_logging_rank:
        path = write(result, dump_folder)
        logger.info("%s\n  written to %s", table(result), path)
    return result
