"""DeepSeek-V3's tensor-parallel plan: the MoE family's for the feed-forward (dense blocks split
like Llama's MLP, MoE layers replicated with the shared experts split), and for MLA the heads
split: wq / wq_b and wkv_b column-wise (each rank computes its heads' queries, no-position keys
and values), wo row-wise; the latent projections wq_a and wkv_a and their norms q_norm and kv_norm
replicated (the latents are small and every head reads all of them, as does the rotated key that
every head shares). Their replicated gradients are complete on every rank: the column-wise
wq_b / wkv_b all-reduce their input gradients (ColwiseParallel's Replicate input), and the rotated
key's gradient, which each rank has for its own heads only, is summed over the TP ranks
(SharedKey) before it reaches wkv_a.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan_amp.models.deepseek_v3.model import MultiTokenPrediction
from torchtitan_amp.models.moe.parallelize import tp_block_plan as moe_plan

_REPLICATED = ("attention.wq_a", "attention.q_norm", "attention.wkv_a", "attention.kv_norm")


class Replicated(ParallelStyle):
    """A module computed whole on every TP rank: its parameters replicated DTensors (one kind of
    parameter for FSDP x TP and the optimizer), its input made a replicated DTensor, its output
    handed back local (or, with `local_output` False, as the replicated DTensor)."""

    def __init__(self, local_output: bool = True) -> None:
        super().__init__()
        self.local_output = local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def _replicate(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                dist = nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), requires_grad=param.requires_grad)
                mod.register_parameter(name, dist)

        def _to_dtensor(_m: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return tuple(
                a if isinstance(a, DTensor) else DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                for a in args
            )

        return distribute_module(
            module,
            device_mesh,
            _replicate,
            input_fn=_to_dtensor,  # type: ignore[arg-type]  # torch types it as returning None
            output_fn=lambda _m, out, _mesh: out.to_local() if self.local_output else out,
        )


class _SumGrad(torch.autograd.Function):
    """x unchanged; backward sums its gradient over `group` (Megatron's copy to the TP region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """x unchanged, with the group backward sums over kept on `ctx`.

        Args:
            ctx: autograd's context.
            x: the tensor passed through.
            group: the TP ranks' process group.
        """
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class SharedKey(Replicated):
    """wkv_a: replicated, its last `rope_dim` outputs (the rotated key every head shares) with their
    gradient summed over the TP ranks, each of which backpropagates its own heads' share."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        group, rope = device_mesh.get_group(), self.rope_dim

        def _sum_key_grad(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            latent, key = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, _SumGrad.apply(key, group)], dim=-1)

        module.register_forward_hook(_sum_key_grad)
        return module


def tp_block_plan(seq: Any, block: Any = None) -> dict[str, Any]:
    """The MoE family's plan with MLA's attention entries in place of grouped-query attention's;
    for a multi-token prediction depth (the model's `mtp`), mtp_plan.

    Args:
        seq: the residual stream's sequence-dim placement (Shard(1) with sequence parallel).
        block: the block or depth being planned (its attention's projections decide the entries).
    """
    if isinstance(block, MultiTokenPrediction):
        return mtp_plan(seq, block)
    gqa = ("attention.wq", "attention.wk", "attention.wv", "attention.q_norm", "attention.k_norm")
    plan = {k: v for k, v in moe_plan(seq, block).items() if k not in gqa}
    attention = block.attention if block is not None else None
    query = "attention.wq" if attention is not None and hasattr(attention, "wq") else "attention.wq_b"
    plan.update({query: ColwiseParallel(), "attention.wkv_b": ColwiseParallel()})
    plan["attention.wo"] = RowwiseParallel(output_layouts=seq)
    for name in _REPLICATED:
        if attention is not None and hasattr(attention, name.split(".")[1]):
            plan[name] = Replicated()
    if attention is not None:
        plan["attention.wkv_a"] = SharedKey(attention.rope)
    return plan


def mtp_plan(seq: Any, depth: MultiTokenPrediction) -> dict[str, Any]:
    """A multi-token prediction depth under TP: its S - k positions replicated over the TP ranks
    (sequence parallel would need the TP degree to divide S - k), so its entry gathers `h` (the
    last block's output, sequence-sharded under SP, for depth 1; the previous depth's, replicated,
    after) and the embeddings, whose shifted slices it then takes. Its block is split as the main
    blocks are without SP (heads, latents replicated, MoE replicated with the shared expert split),
    its norms replicated; eh_proj row-wise (each rank reads its slice of the concatenated
    [enorm(e); hnorm(h)] and the partial sums are all-reduced, the gradient of its input gathered);
    `norm` hands the shared head a replicated DTensor, which the head takes whatever its own input
    layout (vocab-sharded logits under loss parallel, as the main path's).

    Args:
        seq: the residual stream's sequence-dim placement (Shard(1) with sequence parallel).
        depth: the depth being planned (its `k`: 1 reads the last block's output).
    """
    whole = Replicate()
    plan: dict[str, Any] = {f"block.{name}": style for name, style in tp_block_plan(whole, depth.block).items()}
    plan.update({name: Replicated() for name in ("block.attention_norm", "block.ffn_norm", "enorm", "hnorm")})
    plan["eh_proj"] = RowwiseParallel(input_layouts=whole, output_layouts=whole)
    plan["norm"] = Replicated(local_output=False)
    h_layout = seq if depth.k == 1 else whole
    plan[""] = PrepareModuleInput(
        input_layouts=(h_layout, seq, None, None, None),
        desired_input_layouts=(whole, whole, None, None, None),
        use_local_output=True,
    )
    return plan
