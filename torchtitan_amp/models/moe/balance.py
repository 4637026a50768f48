"""Load balancing between steps, and the load metrics.

Auxiliary-loss-free balancing (DeepSeek-V3, torchtitan's default): after each step's backward, the
tokens every expert received are summed over all ranks that saw other tokens (data and context
parallel; under fault tolerance's per-step averaging, over every replica group of the step's
quorum too), and each expert's bias moves by `bias_update_speed` towards the mean load:
delta = speed * sign(mean - load), centred to zero mean (otherwise the biases drift together
step after step, and next to the scores' bf16 resolution they would swamp them). The update is
applied after the optimizer step, and only when that step is applied: a step skipped for
non-finite gradients (fp16 back-off, skip_nonfinite_steps) leaves the biases as they were. The
bias only changes which experts are chosen, never the combine weights. Counts are int64, the bias
fp32, whatever the precision plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_amp.models.moe.moe import MoE


def moe_layers(model_parts: list[nn.Module]) -> list[MoE]:
    return [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model_parts: list[nn.Module], scale: float) -> None:
    """What the trainer multiplies the loss by before backward (loss scale / accumulation steps /
    pipeline microbatches): the auxiliary losses' gradients are scaled alike."""
    for layer in moe_layers(model_parts):
        layer.aux_grad_scale = scale


@torch.no_grad()
def after_backward(
    model_parts: list[nn.Module],
    group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
    cross_group: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Sum the step's per-expert token counts over `group` (and with `cross_group`, which sums
    them in place over the replica groups that average this step's gradients: every group then
    takes the same bias update), compute the expert-bias updates of
    layers balanced by bias (applied by `after_step`), reset the counts; returns the step's load
    metrics: the most and least loaded expert of any layer relative to a uniform load (1.0 is
    perfect balance), over every pipeline stage. Every rank must call it (collectives).

    Args:
        model_parts: the model (its pipeline stages on this rank), whose MoE layers are balanced.
        group: the data-parallel group the counts are summed over; None: this rank's alone.
        pp_group: the pipeline group the load metrics are maxed over; None without pipeline
            parallel.
        cross_group: sums a tensor in place over the fault-tolerance replica groups; None without
            them.
    """
    layers = moe_layers(model_parts)
    # A pipeline stage without MoE layers still joins the stages' all-reduce, with neutral values.
    # Made on the device, not copied from a host list (on CUDA a blocking copy waits for the stream).
    stats = torch.zeros(2, device=next(p.device for part in model_parts for p in part.parameters()))
    stats[1:].fill_(float("-inf"))
    if layers:
        counts = torch.stack([layer.tokens_per_expert for layer in layers])  # [layers, E] int64
        if group is not None:
            dist.all_reduce(counts, group=group)
        if cross_group is not None:
            cross_group(counts)
        loads = counts.double()  # exact for any count below 2**53
        mean = loads.mean(dim=1, keepdim=True)
        for layer, load, avg in zip(layers, loads, mean):
            if layer.load_balance in ("bias", "bias_and_aux_loss"):
                delta = layer.bias_update_speed * torch.sign(avg - load)
                layer.pending_bias_update = (delta - delta.mean()).float()
            layer.tokens_per_expert.zero_()
            if layer.expert_parallel is not None:
                layer.expert_parallel.forget()  # the step's recomputes are done
        ratio = loads / mean.clamp(min=1.0)
        # min as -max so one MAX all-reduce over stages serves both.
        stats = torch.stack([ratio.max(), -ratio.min()]).to(stats.dtype)
    if pp_group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=pp_group)
    # Device tensors, read by the host only on steps that log (no sync on the others); a pipeline
    # whose stages hold no MoE layer at all logs +inf as the least load.
    out = {"moe_load_max": stats[0], "moe_load_min": -stats[1]}
    aux = [layer.last_aux_loss for layer in layers if layer.last_aux_loss is not None]
    if aux:  # this stage's layers, last micro-batch
        out["moe_aux_loss"] = torch.stack(aux).sum()
    return out


@torch.no_grad()
def after_step(model_parts: list[nn.Module]) -> None:
    """After an applied optimizer step: move the expert biases by the updates `after_backward`
    computed for it. Not called for a skipped step, whose updates the next step's replace."""
    for layer in moe_layers(model_parts):
        if layer.pending_bias_update is not None:
            layer.router.expert_bias += layer.pending_bias_update
            layer.pending_bias_update = None
