"""Expert parallel: every MoE layer's routed experts sharded over the EP ranks (E / ep each), tokens
sent to the rank owning their expert and their outputs sent back, by all-to-all.

EP ranks are data-parallel (or context-parallel) ranks, so each routes its own tokens; the routing,
the counts that drive load balancing and the combine stay on the rank that routed, exactly as
without EP. Only the expert matmuls move: the sorted token rows go out in the activations' dtype
(bf16 under mixed precision, what the experts compute in anyway), and come back in it.

Torch pieces: the token exchange is `all_to_all_single_autograd` (its backward is the reverse
all-to-all, present in torch 2.11 and 2.13); the count exchange before it needs no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

# GroupedExperts computes on its weights' local values (moe.local): the dispatched rows are this
# rank's share of a ragged exchange, which no DTensor layout describes.
EXPERT_WEIGHTS = ("w1", "w2", "w3")


@dataclass
class ExpertParallel:
    """What an MoE layer needs to dispatch: the EP group (its rank r owns experts r*E/ep ... )."""

    group: dist.ProcessGroup
    degree: int

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [N, dim] sorted by global expert, counts [E] -> the experts' outputs for those rows,
        in the same order, computed on the ranks owning the experts."""
        ep = self.degree
        send = counts.view(ep, -1)  # [destination rank, its local expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # The one host read the exchange needs: all_to_all's split sizes are host integers.
        send_split, recv_split = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, recv_split, send_split, self.group)
        # Arrived rows are grouped (source rank, local expert); the grouped matmul wants them
        # grouped by local expert, so sort by expert and keep the source order inside each.
        n_local = recv.shape[1]
        segment = torch.arange(recv.numel(), device=recv.device).repeat_interleave(recv.flatten())
        order = ((segment % n_local) * ep + segment // n_local).argsort(stable=True)
        out = experts(arrived[order], recv.sum(0))
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return all_to_all_single_autograd(out[back], send_split, recv_split, self.group)


def shard_experts(experts: nn.Module, mesh) -> None:
    """Turn the experts' [E, ...] weights into DTensors sharded on dim 0 over the mesh's first dim
    (ep) and replicated over the rest (tp, where the MoE layer under TP holds them replicated
    already): each rank keeps its E / ep experts, a checkpoint sees the full [E, ...] tensors (DCP
    reshards them to another EP degree), and FSDP shards them further over the rest of the
    data-parallel ranks."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = [Shard(0), *[Replicate()] * (mesh.ndim - 1)]
    for name in EXPERT_WEIGHTS:
        p = experts._parameters[name]
        whole = p.to_local() if isinstance(p, DTensor) else p.data  # TP-replicated: every rank holds all E
        sharded = distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
