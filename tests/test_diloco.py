"""DiLoCo's arithmetic in one process (train/diloco.py), as numbers: the pseudo-gradient (global -
local, in fp32, rounded once to the wire dtype), the outer Nesterov step against torch.optim.SGD,
a committed sync against a hand-made two-group average, a discarded one (back to the global
weights), and fp32 global weights under bf16 parameters. torchft's all-reduce is replaced by a
stand-in that averages with a given peer; the launches are in test_fault_tolerance.py."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.support.standins import SameValuesManager
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.precision.report import fault_tolerance_summary
from torchtitan_amp.train.diloco import DiLoCo, outer_step, pseudo_gradient
from torchtitan_amp.train.fault_tolerance import FaultTolerance

ON = (
    "--fault_tolerance.enable",
    "true",
    "--fault_tolerance.group_size",
    "2",
    "--fault_tolerance.semi_sync_method",
    "diloco",
    "--mixed_precision.enabled",
    "false",
)
FP32_EPS = 2.0**-23


def _plan(*extra: str) -> PrecisionPlan:
    return PrecisionPlan.from_config(load_config([*ON, *extra]), ParallelDims(1, 1, 1, 1, 1), "cpu", probe=None)


class _Manager(SameValuesManager):
    """torchft's Manager as DiLoCo uses it: the all-reduce averages with `peer` in the wire's
    dtype (sum, then divide, as torchft's AVG does); the sync commits when `commit`."""

    def __init__(self, peer: torch.Tensor, commit: bool) -> None:
        super().__init__()
        self.peer, self.commit = peer, commit

    def should_commit(self) -> bool:
        return self.commit

    def allreduce(self, t: torch.Tensor):
        work = super().allreduce(t)
        t.add_(self.peer.to(t.dtype)).div_(2)
        return work


def _FT(peer: torch.Tensor, commit: bool) -> FaultTolerance:
    """The loop's FaultTolerance over the stand-in Manager."""
    return FaultTolerance(load_config(list(ON)).fault_tolerance, _plan(), manager=_Manager(peer, commit))


def test_the_plan_decides_the_wire_and_the_outer_state() -> None:
    plan = _plan()
    assert (plan.sync_steps, plan.pseudo_gradient_dtype, plan.outer_state_dtype) == (5, torch.float32, torch.float32)
    bf16 = _plan("--fault_tolerance.pseudo_gradient_dtype", "bfloat16", "--fault_tolerance.sync_steps", "7")
    assert (bf16.sync_steps, bf16.pseudo_gradient_dtype, bf16.outer_state_dtype) == (7, torch.bfloat16, torch.float32)
    summary = fault_tolerance_summary(bf16)
    assert summary["pseudo_gradient_dtype"] == "bfloat16" and summary["global_weights_dtype"] == "float32"
    every_step = PrecisionPlan.from_config(load_config(list(ON[:4])), ParallelDims(1, 1, 1, 1, 1), "cpu", probe=None)
    assert every_step.sync_steps == 0 and "semi_sync_method" not in fault_tolerance_summary(every_step)


def test_pseudo_gradient_is_computed_in_fp32_and_rounded_once() -> None:
    torch.manual_seed(0)
    g = [torch.randn(5, 3), torch.randn(7)]
    w = [x + 1e-3 * torch.randn_like(x) for x in g]
    exact = torch.cat([(a.double() - b.double()).reshape(-1) for a, b in zip(g, w)])
    fp32 = pseudo_gradient(g, w, torch.float32)
    # One fp32 subtraction of two fp32 numbers: within half an ulp of the result.
    assert fp32.dtype == torch.float32
    assert torch.all((fp32.double() - exact).abs() <= exact.abs() * FP32_EPS / 2 + 1e-12)
    bf16 = pseudo_gradient(g, w, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))
    # bf16 keeps 8 significant bits (7 stored): half an ulp is at most 2^-8 of the value.
    assert torch.all((bf16.double() - exact).abs() <= exact.abs() * (2.0**-8 + FP32_EPS))
    assert not torch.equal(bf16.float(), fp32)


def test_outer_step_is_torch_nesterov_sgd() -> None:
    torch.manual_seed(1)
    start = [torch.randn(4, 3), torch.randn(6)]
    ours = [t.clone() for t in start]
    momentum = [torch.zeros_like(t) for t in start]
    ref = [nn.Parameter(t.clone().double()) for t in start]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):
        mean = 1e-2 * torch.randn(sum(t.numel() for t in start))
        outer_step(ours, momentum, mean, 0.7, 0.9)
        offset = 0
        for p in ref:
            p.grad = mean[offset : offset + p.numel()].view_as(p).double()
            offset += p.numel()
        sgd.step()
    # A few fp32 roundings per step on weights of size ~1: a small multiple of fp32's eps.
    for a, b in zip(ours, ref):
        assert torch.allclose(a.double(), b.detach(), rtol=0, atol=16 * FP32_EPS * 3)


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(2)
    return nn.Linear(4, 3).to(dtype)


def test_a_committed_sync_steps_the_global_weights_with_the_groups_mean() -> None:
    model = _model()
    params = list(model.parameters())
    peer_delta = 1e-2 * torch.randn(sum(p.numel() for p in params))
    ft = _FT(peer_delta, commit=True)
    diloco = DiLoCo(ft, params, _plan(), outer_lr=0.7, outer_momentum=0.9)
    start = [p.detach().clone() for p in params]
    with torch.no_grad():  # two inner steps' worth of local change
        for p in params:
            p.sub_(0.05)
    diloco.sync(SimpleNamespace(step=5))
    # The mean pseudo-gradient d = (0.05 + peer) / 2; first Nesterov step: g -= lr (1 + mu) d.
    mean = (torch.full_like(peer_delta, 0.05) + peer_delta) / 2
    offset = 0
    for p, s, g, m in zip(params, start, diloco.global_weights, diloco.momentum):
        d = mean[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        # d is within an ulp of 0.05 (fp32 subtraction and mean); weights of size ~1.
        assert torch.allclose(m, d, rtol=4 * FP32_EPS, atol=0), "the first momentum is the mean pseudo-gradient"
        assert torch.allclose(g, s - 0.7 * 1.9 * d, rtol=0, atol=8 * FP32_EPS)
        assert torch.equal(p.detach(), g), "the parameters must continue from the new global weights"
    assert diloco.syncs == 1 and diloco.inner_steps_lost == 0


def test_a_discarded_sync_goes_back_to_the_global_weights() -> None:
    model = _model()
    params = list(model.parameters())
    ft = _FT(torch.zeros(sum(p.numel() for p in params)), commit=False)
    diloco = DiLoCo(ft, params, _plan(), outer_lr=0.7, outer_momentum=0.9)
    start = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    diloco.sync(SimpleNamespace(step=5))
    assert all(torch.equal(p.detach(), s) for p, s in zip(params, start))
    assert all(torch.count_nonzero(m) == 0 for m in diloco.momentum), "a discarded sync moved the momentum"
    assert diloco.syncs == 0 and diloco.inner_steps_lost == 5


def test_global_weights_and_momentum_stay_fp32_under_bf16_parameters() -> None:
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    ft = _FT(torch.zeros(sum(p.numel() for p in params)), commit=True)
    diloco = DiLoCo(ft, params, _plan("--training.dtype", "bfloat16"), outer_lr=0.7, outer_momentum=0.9)
    assert {g.dtype for g in diloco.global_weights} == {m.dtype for m in diloco.momentum} == {torch.float32}
    before = [g.clone() for g in diloco.global_weights]
    with torch.no_grad():  # a local change of one bf16 ulp at most on weights below 1
        for p in params:
            p.copy_(p.float().mul(1 - 2.0**-8).to(torch.bfloat16))
    diloco.sync(SimpleNamespace(step=5))
    # The peer's pseudo-gradient is 0: the mean is half this group's; the fp32 global keeps the
    # step exactly where a bf16 copy would round part of it away.
    for g, b in zip(diloco.global_weights, before):
        assert g.dtype == torch.float32 and not torch.equal(g, b)
    for p, g in zip(params, diloco.global_weights):
        assert torch.equal(p.detach(), g.to(torch.bfloat16))


@pytest.mark.parametrize("steps, last, expected", [(5, 12, True), (6, 12, False), (12, 12, True), (10, 10, True)])
def test_syncs_every_sync_steps_and_at_the_last_step(steps: int, last: int, expected: bool) -> None:
    diloco = DiLoCo(_FT(torch.zeros(15), commit=True), list(_model().parameters()), _plan(), 0.7, 0.9)
    assert diloco.due(steps, last) is expected


def _same_values_diloco(params: list[nn.Parameter], *extra: str, mu: float = 0.9) -> DiLoCo:
    """DiLoCo over a stand-in Manager whose peer group holds the same values (the mean is this
    group's own pseudo-gradient)."""
    ft = FaultTolerance(load_config(list(ON)).fault_tolerance, _plan(), manager=SameValuesManager())
    return DiLoCo(ft, params, _plan(*extra), outer_lr=0.7, outer_momentum=mu)


def test_a_bf16_model_that_did_not_move_sends_a_zero_pseudo_gradient() -> None:
    """Pure bf16 parameters restart each interval from the bf16 rounding of the fp32 global weights:
    the pseudo-gradient is taken against that start, so an interval in which the model did not move
    sends exactly 0 and (no momentum) leaves the global weights as they were."""
    params = list(_model(torch.bfloat16).parameters())
    diloco = _same_values_diloco(params, "--training.dtype", "bfloat16", mu=0.0)
    with torch.no_grad():
        for p in params:
            p.sub_(0.01)
    diloco.sync(SimpleNamespace(step=5))  # global weights now hold bits the bf16 model does not
    assert any(not torch.equal(g, g.to(torch.bfloat16).float()) for g in diloco.global_weights)
    after_first = [g.clone() for g in diloco.global_weights]
    wire = pseudo_gradient(diloco.global_weights, diloco.weights, torch.float32)
    assert torch.count_nonzero(wire) == 0, "the rounding of the global weights was sent as a pseudo-gradient"
    diloco.sync(SimpleNamespace(step=10))
    assert all(torch.equal(g, a) for g, a in zip(diloco.global_weights, after_first))


def test_bf16_diloco_follows_exact_diloco_on_the_same_moves() -> None:
    """12 syncs of a bf16 model whose inner steps move it by fixed amounts, against DiLoCo in
    float64 fed what the model really moved each interval: the fp32 global weights stay within
    fp32 rounding of it (well under a bf16 ulp). Taking the pseudo-gradient against the fp32
    global weights instead drifts by several bf16 ulps (4.6 on average here)."""
    torch.manual_seed(3)
    n = 4096
    param = nn.Parameter(torch.randn(n).to(torch.bfloat16))
    diloco = _same_values_diloco([param], "--training.dtype", "bfloat16")
    ref, ref_m = param.detach().double().clone(), torch.zeros(n, dtype=torch.float64)
    for sync in range(1, 13):
        start = param.detach().clone()
        with torch.no_grad():
            param.copy_(start.float() - 1e-2 * torch.randn(n))
        moved = start.double() - param.detach().double()
        ref_m = 0.9 * ref_m + moved
        ref -= 0.7 * (moved + 0.9 * ref_m)
        diloco.sync(SimpleNamespace(step=5 * sync))
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs())) - 7)
    drift = (diloco.global_weights[0].double() - ref).abs() / ulp
    assert drift.mean() < 1e-3 and drift.max() < 1e-2, f"{drift.mean():.3g} ulp on average, {drift.max():.3g} at most"


def _old_outer_step(global_weights, momentum, mean, lr, mu):
    """The outer step on whole tensors, as one pass (what the chunked one must equal bit for bit)."""
    mean = mean.to(global_weights[0].dtype)
    deltas, offset = [], 0
    for g in global_weights:
        deltas.append(mean[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    torch._foreach_mul_(momentum, mu)
    torch._foreach_add_(momentum, deltas)
    torch._foreach_add_(global_weights, torch._foreach_add(deltas, momentum, alpha=mu), alpha=-lr)


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_sync_is_bitwise_the_whole_one(wire: torch.dtype, chunk: int) -> None:
    torch.manual_seed(4)
    shapes = [(13, 5), (64,), (3, 3, 3), (1,), (200,)]
    g = [torch.randn(s) for s in shapes]
    w = [(x + 1e-2 * torch.randn_like(x)).to(torch.bfloat16) for x in g[:2]] + [x + 1e-2 for x in g[2:]]
    whole = pseudo_gradient(g, w, wire)
    got = pseudo_gradient(g, w, wire, chunk=chunk)
    assert got.dtype == wire and torch.equal(got, whole)
    momentum = [torch.randn_like(x) for x in g]
    ref_g, ref_m = [x.clone() for x in g], [m.clone() for m in momentum]
    _old_outer_step(ref_g, ref_m, whole, 0.7, 0.9)
    outer_step(g, momentum, got, 0.7, 0.9, chunk=chunk)
    assert all(torch.equal(a, b) for a, b in zip(g + momentum, ref_g + ref_m))


class _LiveBytes(TorchDispatchMode):
    """The most bytes that storages made by the ops run under it hold at once: a storage counts from
    the op that made it until the last tensor over it (views included) is gone. Storages that
    existed before (parameters, global weights, momentum) never count."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = self.peak = 0

    def _gone(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.live -= self.size.pop(ptr)
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.refs:
                if ptr in inputs or t._base is not None:
                    continue  # a view or an in-place result of a storage made before
                self.refs[ptr], self.size[ptr] = 0, t.untyped_storage().nbytes()
                self.live += self.size[ptr]
                self.peak = max(self.peak, self.live)
            self.refs[ptr] += 1
            weakref.finalize(t, self._gone, ptr)
        return out


def test_a_sync_holds_the_wire_buffer_and_a_few_chunks(monkeypatch) -> None:
    """A bf16 model with bf16 pseudo-gradients: the sync's temporaries are the wire buffer (this
    rank's shard in the wire dtype, 2 bytes per parameter: the message all-reduced in place, which
    must outlive should_commit) plus at most 3 fp32 chunks, whatever the shard's size. Unchunked, the
    fp32 pseudo-gradient, its fp32 upcast and the outer update were each shard-sized (10 bytes per
    parameter at the outer step)."""
    from torchtitan_amp.train import diloco as diloco_mod

    chunk = 256
    monkeypatch.setattr(diloco_mod, "CHUNK_ELEMENTS", chunk, raising=False)
    torch.manual_seed(5)
    params = list(nn.Linear(200, 100).to(torch.bfloat16).parameters())
    n = sum(p.numel() for p in params)
    diloco = _same_values_diloco(
        params, "--training.dtype", "bfloat16", "--fault_tolerance.pseudo_gradient_dtype", "bfloat16"
    )
    with torch.no_grad():
        for p in params:
            p.sub_(0.01)
    with _LiveBytes() as live:
        diloco.sync(SimpleNamespace(step=5))
    bound = 2 * n + 3 * 4 * chunk
    assert diloco.syncs == 1 and 2 * n <= live.peak <= bound, f"{live.peak} bytes at once; bound {bound}"
