"""Worker behind tests/test_context_parallel_precision.py: context parallel's cross-rank arithmetic
at cp = 1, 2, 4 against an fp64 reference.

    tests/support/launch.py: run_distributed(cp_precision.measure, 4, options, jobs)

`options`: {"batch", "heads", "seq_len", "head_dim", "seeds": [...], "scale": q/k magnitude},
`jobs`: [{"name": NAME, "reduce_dtype": "float32" | "bfloat16"}, ...]. Every job runs the same
attention problems at cp = 1, 2 and 4 (ranks 0..cp-1 form the cp group, `dist.new_group`):

- q, k, v and the output gradient dout, drawn once per seed for the whole window and rounded to
  bf16 (the exact inputs of both computations);
- cp = 1: one bf16 SDPA over the window with the position mask of context_parallel.attention_mask;
- cp > 1: each rank keeps its head-tail chunks of q, k, v (context_parallel.head_tail_positions),
  all-gathers k and v with ContextParallel(group, reduce_dtype).gather_kv (the model's own path),
  runs one bf16 SDPA with the mask of its positions against the gathered ones, and backpropagates
  its chunks of dout: dk and dv come back through the reduce-scatter in `reduce_dtype`;
- the reference: the same q, k, v, dout in fp64, plain causal attention.

Recorded per job, cp and seed: the relative Frobenius error ||x - ref|| / ||ref|| of the output,
dq, dk and dv (each rank's chunks put back in window order), and the dtypes the reduce-scatter
carried (the collective wrapped in this process). Rank 0 returns them (the other ranks None).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_amp.distributed import context_parallel as cp_mod
from torchtitan_amp.distributed.context_parallel import ContextParallel, attention_mask, head_tail_positions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WIRE: list[str] = []  # dtypes the K/V-gradient reduce-scatter carried


def _record_wire() -> None:
    original = cp_mod.collectives()[1]

    def recorded(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        WIRE.append(str(tensor.dtype).removeprefix("torch."))
        return original(tensor, *args, **kwargs)

    cp_mod._REDUCE_SCATTER = recorded


def _problem(seed: int, o: dict[str, Any]) -> list[torch.Tensor]:
    """q, k, v, dout [B, S, H, D], bf16 values (held as bf16)."""
    g = torch.Generator().manual_seed(seed)
    shape = (o["batch"], o["seq_len"], o["heads"], o["head_dim"])
    q, k = (torch.randn(shape, generator=g, dtype=torch.float64) * o["scale"] for _ in range(2))
    v, dout = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.bfloat16() for t in (q, k, v, dout)]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, S, H, D] in, [B, S, H, D] out (the model's layout around SDPA)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None
    )
    return out.transpose(1, 2)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    qd, kd, vd = (t.transpose(1, 2) for t in leaves)
    scores = qd @ kd.transpose(-1, -2) / qd.shape[-1] ** 0.5
    seq = scores.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    out = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vd).transpose(1, 2)
    out.backward(dout.double())
    return [out.detach(), *(t.grad for t in leaves)]


def _run_cp(q, k, v, dout, cp: int, group: Any, reduce_dtype: torch.dtype) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """This rank's share of the cp computation, gathered back to window order (every member)."""
    rank = dist.get_rank(group) if cp > 1 else 0
    keep = head_tail_positions(q.shape[1], cp, rank)
    leaves = [t.index_select(1, keep).requires_grad_() for t in (q, k, v)]
    ql, kl, vl = leaves
    pos = keep.expand(q.shape[0], -1)
    partials: dict[str, torch.Tensor] = {}  # this rank's gradients of the gathered k, v (before the sum)
    if cp > 1:
        context = ContextParallel(group, reduce_dtype)
        kl, vl = context.gather_kv(kl), context.gather_kv(vl)
        kl.register_hook(lambda g: partials.__setitem__("dk", g.detach().clone()))
        vl.register_hook(lambda g: partials.__setitem__("dv", g.detach().clone()))
        kv_pos = context.gather_ids(pos)
    else:
        kv_pos = pos
    out = _sdpa(ql, kl, vl, attention_mask(pos, kv_pos))
    out.backward(dout.index_select(1, keep))
    mine = [out.detach(), *(t.grad for t in leaves)]
    if cp == 1:
        return mine, {}
    sums = _sum_errors(partials, mine[2:], rank, group)
    order = torch.cat([head_tail_positions(q.shape[1], cp, r) for r in range(cp)])
    full = []
    for t in mine:  # fp64 all-gather: a copy, exact
        parts = [torch.empty_like(t, dtype=torch.float64) for _ in range(cp)]
        dist.all_gather(parts, t.double(), group=group)
        window = torch.empty((t.shape[0], q.shape[1], *t.shape[2:]), dtype=torch.float64)
        window[:, order] = torch.cat(parts, 1)
        full.append(window)
    return full, sums


def _sum_errors(partials: dict[str, torch.Tensor], got: list[torch.Tensor], rank: int, group: Any) -> dict[str, float]:
    """The cross-rank sum alone: the ranks' partial gradients of the gathered k (v), bf16, summed
    exactly (fp64 holds a sum of a few bf16 terms exactly) and this rank's slice compared with what
    the reduce-scatter handed back. Per tensor: the relative Frobenius error over the group, and
    `bound_ratio`, the largest ratio of an element's error to what ONE bf16 rounding of an fp32
    sum allows: 2**-8 |exact| + cp * 2**-24 * sum_i |p_i| (round-to-nearest bf16, plus cp - 1
    fp32 additions, each off by at most 2**-24 of a running sum no larger than sum_i |p_i|)."""
    cp, out = dist.get_world_size(group), {}
    for name, mine in zip(("dk", "dv"), got):
        s = mine.shape[1]
        parts = [torch.empty_like(partials[name], dtype=torch.float64) for _ in range(cp)]
        dist.all_gather(parts, partials[name].double(), group=group)
        stacked = torch.stack(parts)[:, :, rank * s : (rank + 1) * s]
        exact, magnitude = stacked.sum(0), stacked.abs().sum(0)
        err = mine.double() - exact
        stats = torch.stack([err.square().sum(), exact.square().sum()])
        dist.all_reduce(stats, group=group)
        ratio = (err.abs() / (2.0**-8 * exact.abs() + cp * 2.0**-24 * magnitude).clamp_min(1e-300)).max().reshape(1)
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX, group=group)
        out[f"{name}_sum"], out[f"{name}_sum_bound_ratio"] = float((stats[0] / stats[1]).sqrt()), float(ratio)
    return out


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def measure(o: dict[str, Any], jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    me, world = dist.get_rank(), dist.get_world_size()
    _record_wire()
    degrees = [c for c in (1, 2, 4, 8) if c <= world]
    # Every rank creates every group, in the same order (new_group is collective).
    groups = {c: dist.new_group(list(range(c))) for c in degrees if c > 1}
    result: dict[str, Any] = {"options": o, "degrees": degrees, "jobs": {}}
    problems = [(_problem(seed, o)) for seed in o["seeds"]]
    references = [_reference(*p) for p in problems] if me == 0 else []
    for job in jobs:
        errors: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        WIRE.clear()
        for cp in degrees:
            if me >= cp:
                continue
            for i, p in enumerate(problems):
                got, sums = _run_cp(*p, cp, groups.get(cp), _DTYPES[job["reduce_dtype"]])
                if me == 0:
                    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, references[i]):
                        errors[str(cp)][name].append(_rel(x, ref))
                    for name, value in sums.items():
                        errors[str(cp)][name].append(value)
        result["jobs"][job["name"]] = {
            "reduce_dtype": job["reduce_dtype"],
            "errors": errors,
            "wire_dtypes": sorted(set(WIRE)),
        }
    # Plain JSON data (the nested defaultdicts cannot be pickled), as the tests read it.
    return json.loads(json.dumps(result)) if me == 0 else None
