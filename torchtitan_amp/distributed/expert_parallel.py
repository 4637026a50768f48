"""Expert parallel: every MoE layer's routed experts sharded over the EP ranks (E / ep each), tokens
sent to the rank owning their expert and their outputs sent back, by all-to-all.

EP ranks are data-parallel (or context-parallel) ranks, so each routes its own tokens; the routing,
the counts that drive load balancing and the combine stay on the rank that routed, exactly as
without EP. Only the expert matmuls move: the sorted token rows go out in the activations' dtype
(bf16 under mixed precision, what the experts compute in anyway), and come back in it.

Torch pieces: the token exchange is `all_to_all_single_autograd` (its backward is the reverse
all-to-all, present in torch 2.11 and 2.13, reusing the forward's split sizes); the count exchange
before it needs no gradient.

Host syncs: all_to_all's split sizes are host integers, so a layer's forward reads them once
(send and receive sizes stacked into one `.tolist()`, torchtitan's figure); everything else stays
on the device (the row order's `repeat_interleave` is given its output size from that read). An
activation-checkpoint recompute runs the forward again inside backward: it takes the counts the
forward received and the sizes it read (kept per layer, first in first out, since microbatches are
recomputed in the order they ran forward) instead of exchanging and reading again, so a step costs
one count all-to-all and one read per layer and microbatch with or without activation
checkpointing; the recompute exchanges only the rows.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger("torchtitan_amp")

# GroupedExperts computes on its weights' local values (moe.local): the dispatched rows are this
# rank's share of a ragged exchange, which no DTensor layout describes.
EXPERT_WEIGHTS = ("w1", "w2", "w3")
# Per-expert biases [E, ...] (gpt-oss's), where the experts have them: split with the weights, since
# the experts index them by local expert.
EXPERT_BIASES = ("b1", "b2", "b3")


@dataclass
class ExpertParallel:
    """What an MoE layer needs to dispatch: the EP group (its rank r owns experts r*E/ep ... )."""

    group: dist.ProcessGroup
    degree: int
    # What this step's grad-enabled forwards exchanged, (rows sent, received counts [ep, E/ep],
    # [send sizes], [receive sizes]), for their recomputes; emptied by `forget` once the step's
    # backward is done.
    read: deque[tuple[int, torch.Tensor, list[int], list[int]]] = field(default_factory=deque)

    def forget(self) -> None:
        """The step's backward is done (or a pass without backward ran): no recompute is due."""
        self.read.clear()

    def exchange_counts(self, rows: int, send: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """The counts each EP rank sends this one ([ep, E/ep], int64, by all-to-all) and the rows
        to send to / receive from each (the one host read of a forward); or, when this is an
        activation-checkpoint recompute (inside backward), what its forward received and read:
        the routing is recomputed bit for bit, so neither the exchange nor the read is repeated."""
        recompute = torch._C._current_graph_task_id() != -1
        if recompute and self.read:
            sent, recv, send_split, recv_split = self.read.popleft()
            if sent != rows:  # a recompute must route like its forward: never exchange wrong sizes
                raise RuntimeError(f"expert parallel: a recompute routes {rows} rows, its forward {sent}")
            return recv, send_split, recv_split
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_split, recv_split = torch.stack([send.sum(1), recv.sum(1)]).tolist()
        if torch.is_grad_enabled() and not recompute:
            self.read.append((rows, recv, send_split, recv_split))
        return recv, send_split, recv_split

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [N, dim] sorted by global expert, counts [E] -> the experts' outputs for those rows,
        in the same order, computed on the ranks owning the experts."""
        ep = self.degree
        send = counts.view(ep, -1)  # [destination rank, its local expert]
        recv, send_split, recv_split = self.exchange_counts(rows.shape[0], send)
        arrived = all_to_all_single_autograd(rows, recv_split, send_split, self.group)
        # Arrived rows are grouped (source rank, local expert); the grouped matmul wants them
        # grouped by local expert, so sort by expert and keep the source order inside each.
        n_local = recv.shape[1]
        # output_size from the host read: without it the kernel would sum the repeats on the host.
        segment = torch.arange(recv.numel(), device=recv.device).repeat_interleave(
            recv.flatten(), output_size=sum(recv_split)
        )
        order = ((segment % n_local) * ep + segment // n_local).argsort(stable=True)
        out = experts(arrived[order], recv.sum(0))
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return all_to_all_single_autograd(out[back], send_split, recv_split, self.group)


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Turn the experts' [E, ...] weights (and biases, where they have them) into DTensors sharded
    on dim 0 over the mesh's first dim (ep) and replicated over the rest (tp, where the MoE layer
    under TP holds them replicated already): each rank keeps its E / ep experts, a checkpoint sees
    the full [E, ...] tensors (DCP reshards them to another EP degree), and FSDP shards them further
    over the rest of the data-parallel ranks."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = [Shard(0), *[Replicate()] * (mesh.ndim - 1)]
    biases = [name for name in EXPERT_BIASES if experts._parameters.get(name) is not None]
    for name in (*EXPERT_WEIGHTS, *biases):
        p = experts._parameters[name]
        assert p is not None  # every expert module registers each of EXPERT_WEIGHTS as a parameter
        whole = p.to_local() if isinstance(p, DTensor) else p.data  # TP-replicated: every rank holds all E
        sharded = distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))


def is_expert_layer(module: nn.Module) -> bool:
    """A layer of routed experts: one whose class declares an `expert_parallel` slot (models/moe's
    MoE), the attribute apply_ep hands the dispatcher to."""
    return hasattr(type(module), "expert_parallel")


def expert_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_expert_layer(m)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, expert_mesh: DeviceMesh) -> None:
    """Split each MoE layer's routed experts over `ep_mesh` and let the layer dispatch to them.

    Under TP `expert_mesh` is (ep, tp): the experts are not split by TP (ETP = 1) and the MoE layer
    is replicated over tp (models/moe/parallelize.py), so every TP rank routes the whole sequence
    and exchanges the same tokens with its EP peers of the same tp coordinate (redundantly:
    torchtitan's ETP = 1 instead takes the tp ranks into the ep group and splits the tokens).

    Args:
        model: the model whose expert layers (a class declaring `expert_parallel`) are split.
        ep_mesh: the one-dim ep mesh; its group carries the all-to-alls.
        expert_mesh: the mesh the experts' weights are distributed on: (ep) or, under TP, (ep, tp).
    """
    layers = expert_layers(model)
    for layer in layers:
        # An expert layer (models/moe's MoE) has `experts` and an `expert_parallel` slot; nn.Module's
        # stubs type unknown attributes as Tensor | Module.
        shard_experts(cast(nn.Module, layer.experts), expert_mesh)
        cast(Any, layer).expert_parallel = ExpertParallel(ep_mesh.get_group(), ep_mesh.size())
    logger.info(
        "applied expert parallel (degree %d) to %d MoE layers: tokens dispatched and combined by "
        "all-to-all in the activations' dtype",
        ep_mesh.size(),
        len(layers),
    )
