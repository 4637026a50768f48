"""The mixture-of-experts layer: a router choosing top-k experts per token, the routed experts as
one grouped matmul, an optional shared expert, and the two load-balancing means.

Precision (decided by the precision plan, which sets `Router.compute_dtype`; see
docs/moe.md): the router is not an nn.Linear, so it stays outside `lower_precision_safe_modules`
and keeps fp32 parameters, an fp32 FSDP group and no autocast; its logits, scores, top-k and the
combine weights are computed in `compute_dtype` (mixed_precision.router_dtype: fp32 by default,
fp64 or bf16 on request), because a rounded score flips which expert a token goes to. The expert
bias and the load counters are fp32 buffers whatever the plan. The experts compute in the
activations' dtype; their outputs are weighted and summed per token in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor

from torchtitan_amp.core.torch_compat import grouped_mm_supported


def local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's values on this rank: under TP the MoE layer's parameters are DTensors
    replicated over the TP ranks (models/moe/parallelize.py), used as plain tensors here."""
    return param.to_local() if isinstance(param, DTensor) else param


class Router(nn.Module):
    """Token -> (combine weights [T, k], chosen experts [T, k]).

    Scores are softmax or sigmoid of the gate logits. With load_balance "bias" (DeepSeek-V3's
    auxiliary-loss-free balancing) a per-expert bias is added to the scores for the choice only;
    the combine weights are the unbiased scores of the chosen experts (renormalised to sum to 1
    when `route_norm`), times `route_scale`. With `n_groups` > 1 (DeepSeek-V3's group-limited
    routing, n_group / topk_group) a token chooses only among the experts of its `topk_groups`
    best groups, a group scored by the sum of its two best biased scores."""

    # The precision plan writes the dtype of the routing arithmetic here
    # (mixed_precision.router_dtype; PrecisionPlan.apply_router_dtype).
    router_dtype: torch.dtype = torch.float32
    expert_bias: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score_func: str,
        route_norm: bool,
        route_scale: float,
        *,
        n_groups: int = 1,
        topk_groups: int = 1,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.top_k, self.score_func, self.route_norm, self.route_scale = top_k, score_func, route_norm, route_scale
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        # A learned bias on the gate logits (gpt-oss's router): a parameter, unlike expert_bias.
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias else None
        # Persistent fp32 buffers: the balancing state is part of a checkpoint.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def reset_parameters(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=init_std)
        nn.init.zeros_(self.expert_bias)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (weights [T, k] in router_dtype, experts [T, k] int64, scores [T, E])."""
        dtype = self.router_dtype
        bias = local(self.bias).to(dtype) if self.bias is not None else None
        logits = F.linear(x.to(dtype), local(self.weight).to(dtype), bias)
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        # The bias moves the choice only (zero until balancing updates it: adding it is then exact).
        choice = scores + self.expert_bias.to(dtype)
        if self.n_groups > 1:
            choice = group_limited(choice, self.n_groups, self.topk_groups)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.route_norm:
            # The epsilon keeps a token whose k sigmoid scores all underflow finite (torchtitan's).
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, experts, scores


def group_limited(choice: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """The choice scores [T, E] with every expert outside a token's `topk_groups` best of
    `n_groups` equal groups set to -inf; a group's score is the sum of its two best (transformers'
    DeepseekV3TopkRouter).

    Args:
        choice: the scores the choice is made on (bias added) [T, E].
        n_groups: the equal groups the E experts are split into (n_group).
        topk_groups: the groups a token may choose from (topk_group).
    """
    tokens, n_experts = choice.shape
    grouped = choice.view(tokens, n_groups, n_experts // n_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(topk_groups, dim=-1).indices
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
    return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(tokens, n_experts)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The experts' default activation: silu(gate) * up."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation, as transformers' GptOssExperts computes it: the gate clamped
    above at `limit`, the up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha *
    gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three [E, ...] weights: w2(act(w1 x, w3 x)) per expert (act: silu(gate)
    * up by default, gpt-oss's ClampedSwiGLU on request), with per-expert biases b1, b3, b2 where
    `bias` (gpt-oss), applied to tokens sorted by expert. `torch._grouped_mm` (one kernel for all
    experts) where this torch and device run it for the dtype, a loop over experts otherwise;
    both give each token its expert's product."""

    # Linears in another form: in lower_precision_safe_modules whenever nn.Linear is (the plan's
    # is_safe), so they compute, gather and reduce like the Linears.
    safe_as = nn.Linear
    # Whether to run torch._grouped_mm: decided once when the model is parallelized
    # (parallelize.apply_expert_kernels), so that a compiled block reads a constant (no probe, no
    # graph break); None (a model used outside the trainer) probes on first use.
    grouped_mm: bool | None = None
    # Set by the precision plan's applier (precision/block_scaled.py) when the experts run
    # block-scaled (mixed_precision.block_scaled_experts): called as mm(x, w, sizes, weight_name)
    # for each of the three GEMMs, in place of the grouped matmul.
    block_scaled_mm: Callable[[torch.Tensor, torch.Tensor, list[int], str], torch.Tensor] | None = None

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        bias: bool = False,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.b2 = nn.Parameter(torch.empty(n_experts, dim)) if bias else None

    def reset_parameters(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)

    def _biased(self, y: torch.Tensor, name: str, rows: torch.Tensor | None) -> torch.Tensor:
        """y plus each row's expert's bias `name` (b1, b2, b3); y itself without biases."""
        b = getattr(self, name)
        return y if b is None or rows is None else y + local(b).to(y.dtype)[rows]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by expert, counts [E] tokens per expert -> [N, dim]."""
        # Each row's expert, for the biases (no host read: the output size is the rows').
        rows = None
        if self.b1 is not None:
            experts = torch.arange(counts.shape[0], device=counts.device)
            rows = torch.repeat_interleave(experts, counts, output_size=x.shape[0])
        act, bias = self.activation, self._biased
        if self.block_scaled_mm is not None:
            # As a block-scaled Linear: the operands as they come (it quantizes them), its
            # output in x's dtype. One host read of the counts (the loop path's).
            mm, sizes = self.block_scaled_mm, counts.tolist()
            w1, w2, w3 = (local(w) for w in (self.w1, self.w2, self.w3))
            h = act(bias(mm(x, w1, sizes, "w1"), "b1", rows), bias(mm(x, w3, sizes, "w3"), "b3", rows))
            return bias(mm(h, w2, sizes, "w2"), "b2", rows)
        # Autocast has no rule for grouped matmuls: on the autocast path take its dtype explicitly
        # (the plan's param dtype), as a Linear would get it; on the FSDP path x is in it already.
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        w1, w2, w3 = (local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if self.grouped_mm if self.grouped_mm is not None else _use_grouped_mm(x):
            offsets = counts.cumsum(0).to(torch.int32)
            gate = bias(torch._grouped_mm(x, w1, offs=offsets), "b1", rows)
            h = act(gate, bias(torch._grouped_mm(x, w3, offs=offsets), "b3", rows))
            return bias(torch._grouped_mm(h, w2, offs=offsets), "b2", rows)
        out = []
        b1, b2, b3 = (None if b is None else local(b).to(x.dtype) for b in (self.b1, self.b2, self.b3))
        # The one host read of this path (a devices or dtype without the grouped kernel).
        for e, part in enumerate(x.split(counts.tolist())):
            gate, up = part @ w1[e], part @ w3[e]
            if b1 is not None and b3 is not None:
                gate, up = gate + b1[e], up + b3[e]
            y = act(gate, up) @ w2[e]
            out.append(y if b2 is None else y + b2[e])
        return torch.cat(out)


@functools.cache
def _grouped_mm_probe() -> Callable[[str, torch.dtype], bool]:
    """The probe for compiled code: under torch.compile it runs eagerly (a graph break: MoE
    blocks compile with breaks). Made on first use: torch.compiler.disable imports dynamo, 0.7 s
    of every process's start-up otherwise."""
    return torch.compiler.disable(grouped_mm_supported)


def grouped_mm_kernel(device: str, dtype: torch.dtype, compiled: bool) -> bool:
    """Whether experts computing in `dtype` on `device` run torch._grouped_mm: where the device's
    kernel runs it and, under torch.compile, only in bf16: the compiler traces _grouped_mm with its
    meta kernel, which takes bf16 only (torch 2.11-2.13) whatever the eager kernels take; fp32
    then runs the loop over experts, with its host read of the counts (a graph break).

    Args:
        device: the device type ("cuda", "cpu").
        dtype: the dtype the experts compute in.
        compiled: whether the model runs under torch.compile.
    """
    return grouped_mm_supported(device, dtype) and (not compiled or dtype == torch.bfloat16)


def _use_grouped_mm(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        # The compiler traces _grouped_mm with its meta kernel, which takes bf16 only (torch
        # 2.11-2.13) whatever the eager kernels take: fp32 runs the loop, split at a graph break.
        return x.dtype == torch.bfloat16 and _grouped_mm_probe()(str(x.device), x.dtype)
    return grouped_mm_supported(str(x.device), x.dtype)


class _CountOnBackward(torch.autograd.Function):
    """Returns x unchanged; its backward adds the forward's per-expert token counts to `total`.
    Counting in backward counts each trained token once: a pipeline schedule's metadata forward
    and evaluation have no backward, and an activation-checkpoint recompute's graph is never
    backpropagated (its saved tensors serve the original forward's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """x unchanged, with what backward needs kept on `ctx`.

        Args:
            ctx: autograd's context.
            x: the tensor passed through.
            counts: this forward's tokens per expert.
            total: the running counts backward adds `counts` to, in place.
        """
        ctx.counts, ctx.total = counts, total
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.total += ctx.counts.to(ctx.total.dtype)
        return grad, None, None


class _AddAuxLoss(torch.autograd.Function):
    """Returns x unchanged; backward also sends `scale` as the gradient of `aux`, so that the
    auxiliary loss joins the training loss without the model returning it (DeepSeek's
    AddAuxiliaryLoss). `scale` is what the trainer multiplies its loss by before backward (loss
    scale / accumulation steps / microbatches), so the aux loss keeps its weight on every path."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        """x unchanged, with what backward needs kept on `ctx`.

        Args:
            ctx: autograd's context.
            x: the tensor passed through.
            aux: the auxiliary loss that receives `scale` as its gradient.
            scale: the trainer's loss multiplier (loss scale / accumulation steps / microbatches).
        """
        ctx.aux_dtype, ctx.scale = aux.dtype, scale
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def sequence_aux_loss(
    scores: torch.Tensor, experts: torch.Tensor, batch: int, alpha: float, cp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, in fp32: per sequence, alpha * sum_i f_i * P_i with
    f_i = E / (k S) x tokens routed to expert i and P_i its mean normalised score over the S tokens.

    Under context parallel a rank holds 2 of a sequence's 2 x cp chunks: the per-sequence counts and
    score sums of the cp ranks are summed first (one all-reduce), so f and P are the sequence's.
    The returned value is the sequence's loss on every cp rank; its gradient is cp x this rank's
    share of it, because the data-parallel gradient mean also divides by the cp ranks.

    Args:
        scores: the router's scores [B, S, E] of this rank's tokens.
        experts: the chosen experts' ids, k per token, int64.
        batch: the sequences B in the microbatch.
        alpha: the loss's weight (aux_loss_alpha).
        cp_group: the context-parallel group the statistics are summed over; None without context
            parallel.
    """
    n_experts, top_k = scores.shape[-1], experts.shape[-1]
    scores = scores.float().view(batch, -1, n_experts)
    prob_sums = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=1)  # [B, E], this rank's tokens
    routed = torch.zeros(batch, n_experts, device=scores.device).scatter_add_(
        1, experts.view(batch, -1), torch.ones(batch, experts.numel() // batch, device=scores.device)
    )
    seq, cp = scores.shape[1], 1
    if cp_group is not None:
        cp = dist.get_world_size(cp_group)
        stats = funcol.wait_tensor(funcol.all_reduce(torch.stack([routed, prob_sums.detach()]), "sum", cp_group))
        routed, seq = stats[0], seq * cp
        whole = alpha * (routed * n_experts / (top_k * seq) * stats[1] / seq).sum(dim=1).mean()
    frac = routed * n_experts / (top_k * seq)
    local = alpha * (frac * prob_sums / seq).sum(dim=1).mean()
    if cp == 1:
        return local
    return local * cp + (whole - local * cp).detach()


class MoE(nn.Module):
    """Routed experts (plus an optional shared SwiGLU expert) in place of a block's MLP."""

    # Set by parallelize.apply_ep under expert parallel (expert_parallel.ExpertParallel): the
    # routed experts live on other ranks too, and tokens travel to them.
    expert_parallel: Any = None
    # Set by parallelize.apply_cp under context parallel (context_parallel.ContextParallel): the
    # sequence-wise aux loss then sums its per-sequence statistics over the cp ranks.
    context_parallel: Any = None
    tokens_per_expert: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        n_shared: int,
        score_func: str,
        route_norm: bool,
        route_scale: float,
        load_balance: str,
        aux_loss_alpha: float,
        bias_update_speed: float,
        *,
        n_groups: int = 1,
        topk_groups: int = 1,
        biases: bool = False,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
    ) -> None:
        # biases: a learned router bias and per-expert biases (gpt-oss); activation: the experts'.
        super().__init__()
        from torchtitan_amp.models.llama3.model import FeedForward

        self.n_experts = n_experts
        self.router = Router(
            dim,
            n_experts,
            top_k,
            score_func,
            route_norm,
            route_scale,
            n_groups=n_groups,
            topk_groups=topk_groups,
            bias=biases,
        )
        self.experts = GroupedExperts(dim, hidden, n_experts, bias=biases, activation=activation)
        self.shared_expert = FeedForward(dim, hidden * n_shared) if n_shared else None
        self.load_balance, self.aux_loss_alpha, self.bias_update_speed = load_balance, aux_loss_alpha, bias_update_speed
        # Set by the trainer before each micro-batch's forward (balance.set_aux_grad_scale): the
        # factor that micro-batch's loss is multiplied by, captured by _AddAuxLoss in forward.
        self.aux_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        # The expert-bias change of the step whose backward just ran, applied only if the optimizer
        # step is (balance.after_backward computes it, balance.after_step applies it).
        self.pending_bias_update: torch.Tensor | None = None
        # Tokens routed to each expert since the last bias update (the balancing signal and the
        # load metrics), in int64: exact whatever the step's token count.
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.int64), persistent=False)

    def reset_step_counters(self) -> None:
        """Forget the tokens counted so far (models/spec.py: the pipeline calls this after torch's
        metadata pass, whose backward would otherwise count a microbatch twice)."""
        self.tokens_per_expert.zero_()
        self.pending_bias_update = None
        if self.expert_parallel is not None:
            self.expert_parallel.forget()  # split sizes kept for recomputes that will not come

    def init_weights(self, init_std: float) -> None:
        # A meta-built model's buffers hold whatever to_empty left in memory.
        self.reset_step_counters()
        self.router.reset_parameters(init_std)
        self.experts.reset_parameters(init_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, experts, scores = self.router(tokens)
        flat = experts.flatten()
        # scatter_add, not bincount: bincount reads its output size on the host (a GPU sync).
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        order = flat.argsort(stable=True)
        rows = self._dispatch_rows(tokens, experts.shape[1], order)
        if self.expert_parallel is None:
            routed = self.experts(rows, counts)
        else:
            routed = self.expert_parallel(self.experts, rows, counts)
        out = self._combine(routed, order, weights, tokens).to(x.dtype)
        if out.requires_grad:
            out = _CountOnBackward.apply(out, counts, self.tokens_per_expert)
        if self.training and self.load_balance in ("aux_loss", "bias_and_aux_loss") and self.aux_loss_alpha > 0:
            cp_group = self.context_parallel.group if self.context_parallel is not None else None
            aux = sequence_aux_loss(scores, experts, batch, self.aux_loss_alpha, cp_group)
            self.last_aux_loss = aux.detach()
            out = _AddAuxLoss.apply(out, aux, self.aux_grad_scale)
        return out.view(batch, seq, dim)

    @staticmethod
    def _dispatch_rows(tokens: torch.Tensor, k: int, order: torch.Tensor) -> torch.Tensor:
        """Each token's row k times, sorted by expert. Copied k times and then permuted, not
        gathered by token (tokens[order // k]): that gather's backward adds a token's k row
        gradients with accumulating index_put, whose order depends on the run (CPU threads,
        CUDA atomics); here they are summed by the copy's backward, a reduction over k, and the
        permutation's backward writes each row once."""
        return tokens.unsqueeze(1).expand(-1, k, -1).reshape(-1, tokens.shape[-1])[order]

    def _combine(
        self, routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """The expert rows (sorted by expert) -> [T, dim] fp32: each token's k weighted outputs
        summed in slot order, then the shared expert added, all in fp32, so that the caller
        rounds once. A gather back to (token, slot) order and a sum over k: no atomics (fp32
        index_add_ on CUDA adds in a run-dependent order), the same sum on every run."""
        k = weights.shape[1]
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        per_slot = routed[back].view(-1, k, routed.shape[-1]).float()
        weights = weights.float().unsqueeze(-1)
        # Slot by slot, not .sum(dim=1): a reduction kernel's order is its own (eager and compiled
        # differ by an ulp), additions written out are the same everywhere.
        out = per_slot[:, 0] * weights[:, 0]
        for slot in range(1, k):
            out = out + per_slot[:, slot] * weights[:, slot]
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens).float()
        return out
