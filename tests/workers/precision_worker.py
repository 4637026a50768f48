"""Multi-process worker behind tests/test_precision_dist.py: the precision proofs.

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        tests/workers/precision_worker.py SPEC.json

(or plain `python tests/workers/precision_worker.py SPEC.json` for the single-process path), where
SPEC is tests/support/launch.py's spec: each job is a scenario, {"name": SCENARIO, "args": OVERRIDES},
and "options": {"shrink": {field: value}}. A parallel layout is nothing but its CLI OVERRIDES (e.g.
`--parallelism.data_parallel_shard_degree 2`), so a new layout (TP, PP) is one more parameter in the
test. Every scenario builds real `Trainer(load_config(BASE + overrides + scenario overrides))`
objects, runs real train steps and records evidence; rank 0 writes OUT_DIR/result.json, which the
pytest side asserts on.

Scenarios (all in one launch to pay process start-up once):

- `probe`   one bf16 step with recorders on: the dtype every nn.Linear returns, what RMSNorm
            computes in and returns, the dtype of the logits the loss sees, the dtype of every
            matmul / log-softmax in forward and backward (a TorchDispatchMode), the rotary
            tables' dtype at the attention, fp32 params / grads / AdamW state, bytes on the wire
            by dtype (DDP: the comm hook; FSDP: reduce-scatter / all-gather / all-reduce), the
            precision report, and an exact hand-written reference of the same step. Runs the
            default config (reduce float32), reduce_dtype bfloat16 (data-parallel layouts),
            param_dtype float32 (FSDP layouts: the all-gather baseline) and `enabled = false`.
- `curve`   trains `steps` steps with the layout's defaults (reduce_dtype float32) and keeps
            the loss curve from metrics.jsonl; `curve_rbf16` the same with reduce_dtype bfloat16
            (DDP: our compress hook; FSDP: bf16 reduce-scatter).
- `fp32curve`  the same with mixed_precision.enabled = false (the reference curve).
- `fp16`    param_dtype float16: a planted overflow (huge init_scale) -> skipped steps, the scale
            backs off, the LR schedule and AdamW stand still on skipped steps, training recovers;
            metrics.jsonl carries loss_scale / skipped_steps; grad norm after unscale vs fp32;
            4 micro-batches vs one batch of 4. Every clip of these runs is checked against the
            fp64 norm of the unscaled gradients (tests/workers/norm_check.py).

`shrink` replaces fields of the debugmodel flavor in this process only (e.g. n_layers=2):
the layer count is the main cost of a CPU step and no claim here depends on depth. The fp16
scenario shrinks further (FP16_SHRINK, seq_len 16): fp16 matmuls are slow on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.launch import exit_process, read_spec
from tests.workers import norm_check
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed.grad_norm import clip_grad_norm_
from torchtitan_amp.models.llama3 import model as llama
from torchtitan_amp.precision import CompressHookState, PrecisionPlan, comm_hooks
from torchtitan_amp.train import build as train_build
from torchtitan_amp.train import trainer as trainer_mod
from torchtitan_amp.train.trainer import Trainer

# Shared by every scenario: global batch 8 whatever the layout, so 1, 2 and 4 data-parallel ranks
# (local batch 2, with 4 / 2 / 1 accumulation micro-batches) see exactly the same 8 sequences per
# step: rank r of R takes permutation positions r, r+R, ..., so the union over ranks of micro-batch
# k ... equals the single process's positions 8s .. 8s+7 (checked by `data_union` below).
BASE = [
    "--mixed_precision.enabled",
    "true",  # bf16 on every CPU kind: these are bf16's proofs
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "15",
    "--training.seed",
    "0",
    "--training.gc_freq",
    "0",
    "--optimizer.lr",
    "1e-2",  # the dim-64 model of the tests falls 6.0 -> 3.2 in 15 steps (3e-3: to 4.1)
    "--lr_scheduler.warmup_steps",
    "5",
    "--metrics.log_freq",
    "1",
]

RANK = int(os.environ.get("RANK", "0"))

# MFU is irrelevant here, and measuring the CPU's peak runs 1024^3 matmuls in the compute dtype:
# in fp16 (~100x slower than bf16 on this CPU) that alone costs 10-40 s per process.
train_build.peak_flops = lambda device, dtype: 1e12  # type: ignore[assignment]


_T0 = time.perf_counter()


def log(*args: Any) -> None:
    if RANK == 0:
        print(f"[precision_worker {time.perf_counter() - _T0:6.1f} s]", *args, flush=True)


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------
# Recorders


class OpDtypes(TorchDispatchMode):
    """Dtypes of the ops that matter, split into forward and backward by autograd's state."""

    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[str]] = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        if name in self.MATMULS or name.startswith("_scaled_dot_product"):
            kind = "matmul" if name in self.MATMULS else "sdpa"
            dtypes = {dname(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            self.seen[f"{kind}_{phase}"] |= dtypes
        elif name in ("_log_softmax", "log_softmax"):
            self.seen[f"log_softmax_{phase}"].add(dname(args[0].dtype))
        return func(*args, **(kwargs or {}))


class Recorder:
    """Forward hooks on nn.Linear / RMSNorm / Attention, wrappers on F.rms_norm and the loss."""

    def __init__(self, model: nn.Module) -> None:
        self.linear_out: set[str] = set()
        self.linear_in: set[str] = set()
        self.linear_weight: set[str] = set()
        self.linear_count = 0
        self.norm_in: set[str] = set()
        self.norm_out: set[str] = set()
        self.norm_mismatch = 0  # RMSNorm outputs whose dtype differs from the input's
        self.rms_norm_compute: set[str] = set()
        self.rotary: set[str] = set()
        self.loss_logits: set[str] = set()
        self.cross_entropy_input: set[str] = set()
        # The weights of the fp32 islands as their forward sees them (after FSDP's all-gather):
        # RMSNorm's own upcast hides a bf16-gathered weight from rms_norm_compute.
        self.norm_weight: set[str] = set()
        self.embedding_weight: set[str] = set()
        self.handles = []
        self._norm_input_dtype: torch.dtype | None = None
        for m in model.modules():
            if isinstance(m, nn.Linear):
                self.handles.append(m.register_forward_hook(self._linear))
            elif isinstance(m, llama.RMSNorm):
                # The caller's view: the input before any FSDP pre-forward cast (prepend), the
                # output after FSDP's post-forward cast (appended last).
                self.handles.append(m.register_forward_pre_hook(self._norm_in, prepend=True))
                self.handles.append(m.register_forward_hook(self._norm_out))
                # Not prepended: runs after FSDP's pre-forward unshard.
                self.handles.append(m.register_forward_pre_hook(self._weight_hook(self.norm_weight)))
            elif isinstance(m, nn.Embedding):
                self.handles.append(m.register_forward_pre_hook(self._weight_hook(self.embedding_weight)))
            elif isinstance(m, llama.Attention):
                self.handles.append(m.register_forward_pre_hook(self._attention))

    def _linear(self, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.linear_count += 1
        self.linear_in.add(dname(local(args[0]).dtype))
        self.linear_out.add(dname(local(out).dtype))
        self.linear_weight.add(dname(local(m.weight).dtype))

    @staticmethod
    def _weight_hook(seen: set[str]):  # type: ignore[no-untyped-def]
        def hook(m: nn.Module, args: tuple) -> None:
            seen.add(dname(local(m.weight).dtype))

        return hook

    def _norm_in(self, m: nn.Module, args: tuple) -> None:
        self._norm_input_dtype = args[0].dtype
        self.norm_in.add(dname(args[0].dtype))

    def _norm_out(self, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.norm_out.add(dname(out.dtype))
        self.norm_mismatch += out.dtype != self._norm_input_dtype

    def _attention(self, m: nn.Module, args: tuple) -> None:
        # (x, cos, sin): the rotary tables as the attention receives them.
        self.rotary |= {dname(a.dtype) for a in args[1:3]}

    @contextlib.contextmanager
    def patched(self):  # type: ignore[no-untyped-def]
        orig_rms, orig_ce, orig_loss = F.rms_norm, F.cross_entropy, trainer_mod.loss_fn

        def rms_norm(x, shape, weight=None, eps=None):  # type: ignore[no-untyped-def]
            self.rms_norm_compute.add(dname(x.dtype))
            if weight is not None:
                self.rms_norm_compute.add(dname(weight.dtype))
            return orig_rms(x, shape, weight, eps)

        def cross_entropy(x, *a, **k):  # type: ignore[no-untyped-def]
            self.cross_entropy_input.add(dname(local(x).dtype))
            return orig_ce(x, *a, **k)

        def loss_fn(logits, labels, **kwargs):  # type: ignore[no-untyped-def]
            self.loss_logits.add(dname(local(logits).dtype))
            return orig_loss(logits, labels, **kwargs)

        F.rms_norm, F.cross_entropy, trainer_mod.loss_fn = rms_norm, cross_entropy, loss_fn
        try:
            yield self
        finally:
            F.rms_norm, F.cross_entropy, trainer_mod.loss_fn = orig_rms, orig_ce, orig_loss
            for h in self.handles:
                h.remove()

    def as_dict(self) -> dict[str, Any]:
        return {
            k: sorted(v) if isinstance(v, set) else v
            for k, v in vars(self).items()
            if not k.startswith("_") and k != "handles"
        }


class WireCounter:
    """Bytes this rank hands to the FSDP collectives, by collective and dtype."""

    def __init__(self) -> None:
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._orig = {}

    @contextlib.contextmanager
    def patched(self):  # type: ignore[no-untyped-def]
        def wrap(key: str, names: tuple[str, ...], tensor_arg: str, pos: int):  # type: ignore[no-untyped-def]
            # The first of `names` this torch has is the one its FSDP2 calls (torch 2.13:
            # *_single; 2.11: all_gather_into_tensor / reduce_scatter_tensor), counted under `key`.
            name = next(n for n in names if hasattr(dist, n))
            orig = getattr(dist, name)
            self._orig[name] = orig

            def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
                t = kwargs.get(tensor_arg, args[pos] if len(args) > pos else None)
                if isinstance(t, torch.Tensor) and t.numel() > 1:  # scalars: norms, loss means
                    self.bytes[key][dname(t.dtype)] += t.numel() * t.element_size()
                return orig(*args, **kwargs)

            setattr(dist, name, counted)

        wrap("all_gather", ("all_gather_single", "all_gather_into_tensor"), "input_tensor", 1)
        wrap("reduce_scatter", ("reduce_scatter_single", "reduce_scatter_tensor"), "input", 1)
        wrap("all_reduce", ("all_reduce",), "tensor", 0)
        try:
            yield self
        finally:
            for name, orig in self._orig.items():
                setattr(dist, name, orig)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.bytes.items()}


def counting_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default fp32 all-reduce, counting bytes (for the reduce_dtype=float32 comparison)."""
    buf = bucket.buffer()
    state.bytes_sent[dname(buf.dtype)] += buf.numel() * buf.element_size()
    buf.div_(dist.get_world_size(state.group))
    return dist.all_reduce(buf, group=state.group, async_op=True).get_future().then(lambda f: f.value()[0])


# ---------------------------------------------------------------------------------------------
# Helpers


def make_trainer(out: Path, name: str, overrides: list[str], extra: list[str]) -> Trainer:
    dump = out / name
    return Trainer(load_config(BASE + overrides + ["--job.dump_folder", str(dump)] + extra))


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def take_batches(trainer: Trainer, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(trainer.run.dataloader)
    return [next(it) for _ in range(n)]


def params_of(trainer: Trainer) -> list[nn.Parameter]:
    return list(trainer.run.params)


def tensor_dtypes(trainer: Trainer) -> dict[str, list[str]]:
    params = params_of(trainer)
    state = [trainer.run.optimizer.state[p] for p in params]
    return {
        "param": sorted({dname(p.dtype) for p in params} | {dname(local(p).dtype) for p in params}),
        "grad": sorted({dname(local(p.grad).dtype) for p in params if p.grad is not None}),
        "grads_missing": sum(p.grad is None for p in params),
        "optim_state": sorted(
            {dname(local(v).dtype) for s in state for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor)}
        ),
        "optim_state_tensors": sum(1 for s in state for k in s if k != "step"),
    }


def gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def merge_ranks(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Lists become their sorted union over ranks, counts their sum."""
    merged: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, list):
                merged[k] = sorted(set(merged.get(k, [])) | set(v))
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                merged[k] = merged.get(k, 0) + v
            else:
                merged.setdefault(k, v)
    return merged


def numel_by_safety(model: nn.Module, safe: tuple[type, ...]) -> dict[str, int]:
    counts = {"safe": 0, "unsafe": 0}
    for m in model.modules():
        n = sum(full(p).numel() for p in m.parameters(recurse=False))
        counts["safe" if isinstance(m, safe) else "unsafe"] += n
    return counts


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Exact equality per tensor, and the worst relative difference if any differ."""
    unequal = [n for n in a if not torch.equal(a[n], b[n])]
    worst = 0.0
    for n in a:
        denom = b[n].float().abs().max().clamp_min(1e-30)
        worst = max(worst, float((a[n].float() - b[n].float()).abs().max() / denom))
    return {"exact": not unequal, "unequal": unequal[:5], "num_unequal": len(unequal), "max_rel": worst}


# ---------------------------------------------------------------------------------------------
# Hand-written references of one optimizer step (the way PyTorch's FSDP2 mixed-precision tests do)


def _groups(trainer: Trainer) -> tuple[dist.ProcessGroup | None, ...]:
    """Process groups a gradient is reduced over, in the order the parallel path reduces."""
    dims = trainer.run.dims
    if dims.world_size == 1 or not dims.dp_enabled:
        return ()
    mesh = dims.mesh
    if dims.hsdp_enabled:
        return (mesh["dp_shard"].get_group(), mesh["dp_replicate"].get_group())
    if dims.fsdp_enabled:
        return (mesh["dp_shard"].get_group(),)
    return (mesh["dp_replicate"].get_group(),)


def reference_step(
    trainer: Trainer, init: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float
) -> tuple[dict, dict]:
    """One optimizer step written out by hand from the plan's dtypes; returns (grads, params).

    autocast path (single process, DDP): an fp32 copy run under torch.autocast(param_dtype) for
    forward + loss, backward outside it, logits cast to output_dtype.
    fsdp path: a low-precision copy (safe modules' weights in param_dtype, the others fp32; each
    block gets its hidden state cast to param_dtype while the rotary tables stay fp32; logits cast
    to output_dtype), no autocast.
    full path: the fp32 copy as is.
    Gradient reduction: each gradient is cast to reduce_dtype (safe modules, when the path reduces
    in low precision) or fp32, divided by the group size and all-reduced over the shard group
    (then the replicate group for HSDP) or the DDP group, and cast back to fp32. FSDP reduces
    every micro-batch and accumulates in fp32; DDP accumulates locally and reduces once.
    Both end with the trainer's AdamW, re-built on fp32 master weights, at the LR of step 1.
    """
    plan: PrecisionPlan = trainer.run.plan
    master_model = llama.Transformer(trainer.run.job.model_args)
    master_model.load_state_dict(init)
    master = dict(master_model.named_parameters())
    safe_names = {
        f"{mn}.{pn}" if mn else pn
        for mn, m in master_model.named_modules()
        if plan.is_safe(m)
        for pn, _ in m.named_parameters(recurse=False)
    }
    groups = _groups(trainer)
    per_micro_reduce = trainer.run.dims.fsdp_enabled
    accum = len(batches)

    def reduce(g: torch.Tensor, name: str) -> torch.Tensor:
        low = plan.path != "full" and name in safe_names and (plan.path == "fsdp" or plan.comm_hook != "none")
        g = g.to(plan.reduce_dtype if low else torch.float32, copy=True)
        for group in groups:
            g.div_(dist.get_world_size(group))
            dist.all_reduce(g, group=group)
        return g.float()

    model, ctx, out_dtype = master_model, contextlib.nullcontext, None
    if plan.path == "fsdp":
        model = llama.Transformer(trainer.run.job.model_args)
        model.load_state_dict(init)
        for m in model.modules():
            if plan.is_safe(m):
                for p in m.parameters(recurse=False):
                    p.data = p.data.to(plan.param_dtype)
        for block in model.layers.values():
            block.register_forward_pre_hook(lambda mod, args: (args[0].to(plan.param_dtype),) + tuple(args[1:]))
        out_dtype = plan.output_dtype
    elif plan.path == "autocast":
        ctx = lambda: torch.autocast("cpu", dtype=plan.param_dtype)  # noqa: E731
        out_dtype = plan.output_dtype
    params = dict(model.named_parameters())
    acc: dict[str, torch.Tensor] = {}
    for x, y in batches:
        with ctx():
            logits = model(x)
            logits = logits.to(out_dtype) if out_dtype is not None else logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / accum
        loss.backward()
        if per_micro_reduce:
            for n, p in params.items():
                g = reduce(p.grad, n)
                acc[n] = g if n not in acc else acc[n] + g
                p.grad = None
    for n, p in master.items():
        if per_micro_reduce:
            p.grad = acc[n]
        elif groups:
            p.grad = reduce(p.grad, n)
    grads = {n: p.grad.detach().clone() for n, p in master.items()}
    opt = trainer.run.optimizer
    accepted = inspect.signature(type(opt).__init__).parameters
    ref_opt = type(opt)(list(master.values()), **{k: v for k, v in opt.defaults.items() if k in accepted})
    for g in ref_opt.param_groups:
        g["lr"] = lr
    ref_opt.step()
    return grads, {n: p.detach().clone() for n, p in master.items()}


# ---------------------------------------------------------------------------------------------
# Scenarios


def probe_one(out: Path, name: str, overrides: list[str], extra: list[str]) -> dict[str, Any]:
    captured: list[CompressHookState | None] = []
    orig_state = comm_hooks.comm_hook_state

    def capture(plan, model, group):  # type: ignore[no-untyped-def]
        state = orig_state(plan, model, group)
        captured.append(state)
        return state

    comm_hooks.comm_hook_state = capture
    try:
        trainer = make_trainer(out, name, overrides, ["--training.max_norm", "0"] + extra)
    finally:
        comm_hooks.comm_hook_state = orig_state
    plan, dims = trainer.run.plan, trainer.run.dims
    parts = list(trainer.run.model_parts)
    hook_state = captured[0] if captured else None
    if dims.ddp_enabled and hook_state is None:
        # fp32 reduce: no hook of ours is installed; count DDP's plain fp32 all-reduce instead.
        hook_state = CompressHookState(dims.mesh["dp_replicate"].get_group(), torch.float32, frozenset())
        trainer.run.model.register_comm_hook(hook_state, counting_allreduce_hook)
    init = full_state(trainer.run.model)
    batches = take_batches(trainer, trainer.run.accum)
    lr = trainer.run.optimizer.param_groups[0]["lr"]
    recorder, ops, wire = Recorder(nn.ModuleList(parts)), OpDtypes(), WireCounter()
    with recorder.patched(), wire.patched(), ops:
        loss, grad_norm, stepped = trainer.train_step(iter(batches))
    result: dict[str, Any] = {
        "dims": {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "world_size")},
        "path": plan.path,
        "accum": trainer.run.accum,
        "loss": float(loss),
        "loss_dtype": dname(loss.dtype),
        "grad_norm": float(grad_norm),
        "stepped": bool(stepped),
        # Union over ranks: under PP the loss and the last blocks run on another rank than rank 0.
        "dtypes": merge_ranks(gather_objects(recorder.as_dict())),
        "ops": merge_ranks(gather_objects({k: sorted(v) for k, v in ops.seen.items()})),
        "tensors": tensor_dtypes(trainer),
        "fsdp_wire": wire.as_dict(),
        "ddp_wire": dict(hook_state.bytes_sent) if hook_state is not None else None,
        "numel": numel_by_safety(nn.ModuleList(parts), plan.safe_modules or (nn.Linear,)),
        "report": json.loads((out / name / "precision_report.json").read_text()) if RANK == 0 else None,
        "rope_buffer_dtype": dname(trainer.run.model.rope_cos.dtype),
    }
    trained_grads = {n: full(p.grad).clone() for n, p in trainer.run.model.named_parameters()}
    trained_params = full_state(trainer.run.model)
    if not (dims.tp_enabled or dims.pp_enabled):
        grads, params = reference_step(trainer, init, batches, lr)
        result["reference"] = {
            "grads": compare(trained_grads, grads),
            "params": compare(trained_params, params),
            "lr": lr,
        }
    # The union of the ranks' first micro-batches, for the data-alignment check.
    result["first_tokens"] = gather_objects([b[0][:, :4].tolist() for b in batches])
    return result


def scenario_probe(out: Path, overrides: list[str]) -> dict[str, Any]:
    """Probes: the default config; bf16 reduce (data parallel only); for FSDP layouts an
    fp32-param run with the same FSDP groups (the all-gather baseline); enabled = false."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {"default": probe_one(out, "probe_default", overrides, [])}
    if world > 1:
        results["reduce_bf16"] = probe_one(
            out, "probe_reduce_bf16", overrides, ["--mixed_precision.reduce_dtype", "bfloat16"]
        )
    if results["default"]["path"] == "fsdp":
        results["param_fp32"] = probe_one(
            out, "probe_param_fp32", overrides, ["--mixed_precision.param_dtype", "float32"]
        )
    results["disabled"] = probe_one(out, "probe_disabled", overrides, ["--mixed_precision.enabled", "false"])
    return results


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def scenario_curve(out: Path, name: str, overrides: list[str], extra: list[str]) -> dict[str, Any]:
    trainer = make_trainer(out, name, overrides, extra)
    trainer.train()
    rows = read_metrics(out / name) if RANK == 0 else []
    return {
        "loss": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "path": trainer.run.plan.path,
        "comm_hook": trainer.run.plan.comm_hook,
    }


# fp16 matmuls are ~100x slower than bf16 on this CPU: the fp16 scenario uses a smaller model.
FP16_SHRINK = {"n_layers": 1, "dim": 64, "n_heads": 4}


@contextlib.contextmanager
def flavor(**fields: int):  # type: ignore[no-untyped-def]
    saved = llama.LLAMA3_FLAVORS["debugmodel"]
    llama.LLAMA3_FLAVORS["debugmodel"] = dataclasses.replace(saved, **fields)
    try:
        yield
    finally:
        llama.LLAMA3_FLAVORS["debugmodel"] = saved


def scenario_fp16(out: Path, overrides: list[str]) -> dict[str, Any]:
    # norm_check: each fp16 run's gradient norm and clipping against the fp64 norm of the
    # unscaled gradients (the trainer clips after scaler.unscale_).
    with flavor(**FP16_SHRINK), norm_check.checking():
        return _scenario_fp16(out, overrides + ["--training.seq_len", "16"])


def _scenario_fp16(out: Path, overrides: list[str]) -> dict[str, Any]:
    fp16 = ["--mixed_precision.param_dtype", "float16", "--mixed_precision.reduce_dtype", "float32"]
    res: dict[str, Any] = {}

    # 1. Planted overflow: init_scale 2**40 overflows fp16 activation gradients until the scale
    #    has backed off far enough. Record every step.
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the process group starts with the trainer
    trainer = make_trainer(
        out,
        "fp16_overflow",
        overrides,
        fp16
        + [
            "--mixed_precision.init_scale",
            str(2.0**40),
            "--mixed_precision.backoff_factor",
            "0.0625",
            "--training.steps",
            "18",
            "--lr_scheduler.warmup_steps",
            "2",
            "--training.global_batch_size",
            str(2 * world),
        ],
    )
    per_step: list[dict[str, Any]] = []
    orig_step = trainer.train_step
    params = params_of(trainer)

    def recorded(batches):  # type: ignore[no-untyped-def]
        before = torch.cat([local(p.detach()).flatten().float() for p in params]).clone()
        scale_before = trainer.run.scaler.get_scale()
        lr_before = trainer.run.optimizer.param_groups[0]["lr"]
        epoch_before = trainer.run.lr_scheduler.last_epoch
        loss, grad_norm, stepped = orig_step(batches)
        after = torch.cat([local(p.detach()).flatten().float() for p in params])
        adam_steps = sorted(
            {float(trainer.run.optimizer.state[p]["step"]) for p in params if "step" in trainer.run.optimizer.state[p]}
        )
        per_step.append(
            {
                "stepped": bool(stepped),
                "scale_before": scale_before,
                "scale_after": trainer.run.scaler.get_scale(),
                "lr_used": lr_before,
                "sched_epoch_before": epoch_before,
                "sched_epoch_after": trainer.run.lr_scheduler.last_epoch,
                "params_changed": bool(not torch.equal(before, after)),
                "adam_steps": adam_steps,
                "grad_norm": float(grad_norm),
                "loss": float(loss),
                "grads_finite": bool(all(torch.isfinite(local(p.grad)).all() for p in params if p.grad is not None)),
            }
        )
        return loss, grad_norm, stepped

    trainer.train_step = recorded  # type: ignore[method-assign]
    norm_check.reset()
    trainer.train()
    res["overflow"] = {
        "steps": gather_objects(per_step),
        "skipped_steps": trainer.run.scaler.skipped_steps,
        "norm_check": gather_objects(norm_check.records()),
        "grad_scaler": trainer.run.plan.grad_scaler,
        "scaler_type": type(trainer.run.scaler.scaler).__name__,
        "metrics": read_metrics(out / "fp16_overflow") if RANK == 0 else [],
    }

    # 2. Clipping sees unscaled gradients: step-1 grad norm under fp16 (scale 2**12, no overflow)
    #    against the fp32 trainer's on the same weights and data.
    norms = {}
    for name, extra in (
        ("fp16_norm", fp16 + ["--mixed_precision.init_scale", str(2.0**12)]),
        ("fp32_norm", ["--mixed_precision.enabled", "false"]),
    ):
        t = make_trainer(out, name, overrides, extra + ["--training.max_norm", "1e-3"])
        norm_check.reset()
        loss, grad_norm, stepped = t.train_step(iter(take_batches(t, t.run.accum)))
        checked = gather_objects(norm_check.records())
        # After clipping to 1e-3 the gradients' own norm must be 1e-3: clipping acted on true grads.
        # The trainer's norm (max_norm 0: measure only) covers every shard, TP and PP included.
        post = clip_grad_norm_(t.run.params, 0.0, t.run.groups.pp, device=t.run.device)
        norms[name] = {
            "grad_norm": float(grad_norm),
            "stepped": bool(stepped),
            "scale": t.run.scaler.get_scale(),
            "post_clip_norm": float(post),
            "norm_check": checked,
        }
    res["norms"] = norms

    # 3. Accumulation: global batch 4 x world as 4 micro-batches of 1 vs micro-batches of 4.
    gb = str(4 * world)
    accum_runs = {}
    for name, lb in (("fp16_accum4", "1"), ("fp16_accum1", "4")):
        t = make_trainer(
            out,
            name,
            overrides,
            fp16
            + [
                "--training.local_batch_size",
                lb,
                "--training.global_batch_size",
                gb,
                "--mixed_precision.init_scale",
                str(2.0**12),
                "--training.max_norm",
                "0",
            ],
        )
        loss, grad_norm, stepped = t.train_step(iter(take_batches(t, t.run.accum)))
        accum_runs[name] = {
            "accum": t.run.accum,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "stepped": bool(stepped),
            "grads": {n: full(p.grad).clone() for n, p in t.run.model.named_parameters()},
            "params": full_state(t.run.model),
        }
    a, b = accum_runs["fp16_accum4"], accum_runs["fp16_accum1"]
    rel_grad = max(
        float((a["grads"][n] - b["grads"][n]).norm() / b["grads"][n].norm().clamp_min(1e-30)) for n in a["grads"]
    )
    res["accum"] = {k: {kk: vv for kk, vv in v.items() if kk not in ("grads", "params")} for k, v in accum_runs.items()}
    res["accum"]["max_rel_grad_diff"] = rel_grad
    res["accum"]["max_abs_param_diff"] = max(float((a["params"][n] - b["params"][n]).abs().max()) for n in a["params"])
    return res


def main(spec_path: str) -> int:
    spec = read_spec(spec_path)
    out, shrink = spec.out, spec.options.get("shrink", {})
    if shrink:
        llama.LLAMA3_FLAVORS["debugmodel"] = dataclasses.replace(llama.LLAMA3_FLAVORS["debugmodel"], **shrink)
    result: dict[str, Any] = {"shrink": shrink, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    started = time.perf_counter()
    for job in spec.jobs:
        scenario, overrides = job["name"], job["args"]
        log(f"scenario {scenario} at {time.perf_counter() - started:.1f} s")
        if scenario == "probe":
            result["probe"] = scenario_probe(out, overrides)
        elif scenario == "curve":
            result["curve"] = scenario_curve(out, "curve", overrides, [])
        elif scenario == "curve_rbf16":
            # bf16 gradient reduction (DDP: our compress hook; FSDP: reduce-scatter in bf16).
            result["curve_rbf16"] = scenario_curve(
                out, "curve_rbf16", overrides, ["--mixed_precision.reduce_dtype", "bfloat16"]
            )
        elif scenario == "fp32curve":
            result["fp32curve"] = scenario_curve(out, "fp32curve", overrides, ["--mixed_precision.enabled", "false"])
        elif scenario == "fp16":
            result["fp16"] = scenario_fp16(out, overrides)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    log(f"done at {time.perf_counter() - started:.1f} s")
    if RANK == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
