"""Megatron-style tensor parallel (DTensor): a block's plan comes from its family, the decoder's ends
(embedding row-wise, output column-wise, final norm) are the same for every family; loss parallel and
async TP (inductor's micro-pipelining) are switched here. A LoRA-adapted Linear (one with `lora_A` /
`lora_B` adapter Linears, precision/lora.py) splits its adapters to match its base's style."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from torchtitan_amp.config import JobConfig
from torchtitan_amp.distributed.blocks import side_blocks
from torchtitan_amp.distributed.parallel_dims import ParallelDims

logger = logging.getLogger("torchtitan_amp")


def loss_parallel_enabled(dims: ParallelDims, config: JobConfig) -> bool:
    return dims.tp_enabled and not config.parallelism.disable_loss_parallel


def parallel_context(dims: ParallelDims, config: JobConfig) -> contextlib.AbstractContextManager:
    """The context both forward+loss and backward need for parallelism (not precision)."""
    return loss_parallel() if loss_parallel_enabled(dims, config) else contextlib.nullcontext()


def apply_tp(
    model: nn.Module,
    block_plan: Callable[[object, nn.Module], dict],
    block_norms: tuple[str, ...],
    mesh: DeviceMesh,
    loss_parallel_on: bool,
    sequence_parallel: bool,
) -> None:
    """Megatron-style TP: each block by its family's plan (Llama: q/k/v and w1/w3 column-wise, wo
    and w2 row-wise), its norms sequence-parallel; the embedding row-wise, the output column-wise.

    Absent stage ends (pipeline parallel sets them to None) are skipped.

    Args:
        model: the decoder (models/spec.py's shape), parallelized in place.
        block_plan: the family's `block_plan(sequence layout, block)`: submodule name -> torch
            ParallelStyle for one block, or for one side block (models/spec.py's `mtp` depths),
            its norms included.
        block_norms: the block's norm submodules: sequence-parallel with SP, else replicated.
        mesh: the one-dim tp mesh.
        loss_parallel_on: True when the output stays vocab-sharded for loss parallel.
        sequence_parallel: True to shard activations along the sequence between blocks (SP).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    # Any: the decoder shape of models/spec.py, whose ends a pipeline stage may set to None.
    decoder: Any = model
    tied = (
        decoder.tok_embeddings is not None
        and decoder.output is not None
        and decoder.output.weight is decoder.tok_embeddings.weight
    )
    top: dict[str, ParallelStyle] = {}
    if decoder.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if decoder.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if decoder.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
            use_local_output=not loss_parallel_on,
        )
    parallelize_module(model, mesh, top)
    if tied:
        # Each style distributed its own module's copy; both shard the vocab rows (Shard(0)), so
        # the embedding's DTensor serves the output too, and both uses add into one gradient.
        decoder.output.weight = decoder.tok_embeddings.weight
    for block in decoder.layers.values():
        styles = block_plan(seq, block)
        if sequence_parallel:
            styles.update({name: SequenceParallel() for name in block_norms})
        else:
            for name in block_norms:
                _replicate_params(getattr(block, name), mesh)
        parallelize_module(block, mesh, {name: _adapted(style, block, name) for name, style in styles.items()})
    for depth in side_blocks(model):
        # A side block (multi-token prediction depth): the family's plan covers all of it, norms too.
        styles = block_plan(seq, depth)
        parallelize_module(depth, mesh, {name: _adapted(style, depth, name) for name, style in styles.items()})
    if decoder.norm is not None and not sequence_parallel:
        _replicate_params(decoder.norm, mesh)
    logger.info(
        "applied tensor parallel (degree %d, sequence parallel %s, loss parallel %s)",
        mesh.size(),
        sequence_parallel,
        loss_parallel_on,
    )


class AdaptedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a LoRA-adapted Linear: base weight (and bias) Shard(0), lora_A [r, in]
    replicated, lora_B [out, r] Shard(0). Both paths end in output columns: B(A(x)) is Shard(-1)
    like the base's x @ W.T, and their sum leaves as the base's output would."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _split_adapted(name, module, device_mesh, {"": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)})


class AdaptedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a LoRA-adapted Linear: base weight Shard(1) (bias replicated), lora_A
    [r, in] Shard(1), lora_B [out, r] replicated. A(x) is a partial sum over the input shards, and
    B of it stays partial (B is linear), so base + B(A(x)) is one partial sum: reduced (or
    reduce-scattered under SP) once, by the same collective as the base's output."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _split_adapted(name, module, device_mesh, {"": Shard(1), "lora_A": Shard(1), "lora_B": Replicate()})


def _split_adapted(name: str, module: nn.Module, mesh: DeviceMesh, weights: dict[str, Placement]) -> None:
    """distribute_module's partition_fn, called for the adapted Linear ("") and each submodule:
    its own weight by `weights`, a bias replicated unless the weight is Shard(0) (then Shard(0))."""
    if name not in weights:  # lora_dropout: no parameters
        return
    for pname, p in list(module.named_parameters(recurse=False)):
        placement = weights[name] if pname == "weight" or weights[name] == Shard(0) else Replicate()
        module.register_parameter(
            pname, nn.Parameter(distribute_tensor(p, mesh, [placement]), requires_grad=p.requires_grad)
        )


def _adapted(style: ParallelStyle, block: nn.Module, name: str) -> ParallelStyle:
    """The style for `block.name`: a LoRA-adapted Linear's ColwiseParallel / RowwiseParallel becomes
    its Adapted twin (same layouts), every other style is itself."""
    module = block.get_submodule(name)
    if not (hasattr(module, "lora_A") and isinstance(style, (ColwiseParallel, RowwiseParallel))):
        return style
    if type(style) not in (ColwiseParallel, RowwiseParallel):
        raise NotImplementedError(f"LoRA under tensor parallel: {name}'s {type(style).__name__} has no adapter split")
    twin = AdaptedColwiseParallel if isinstance(style, ColwiseParallel) else AdaptedRowwiseParallel
    return twin(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )


def linear_shard_dims(model: nn.Module, block_plan: Callable[[object, nn.Module], dict]) -> dict[str, int]:
    """The weight dim apply_tp shards, by module name: 0 for the blocks' column-wise Linears, 1 for
    the row-wise ones (what a check of per-rank shapes needs before the model is split)."""
    dims = {}
    for block_name, block in cast(nn.ModuleDict, model.layers).items():  # the decoder shape of models/spec.py
        for name, style in block_plan(Replicate(), block).items():
            if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                dims[f"layers.{block_name}.{name}"] = 0 if isinstance(style, ColwiseParallel) else 1
    return dims


def apply_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor micro-pipeline TP (all-gather/reduce-scatter fused with the matmuls) in the
    compiled blocks. validate_layout has checked CUDA + compile + TP degree > 1."""
    import torch._inductor.config
    from torch.distributed import _symmetric_memory

    torch._inductor.config._micro_pipeline_tp = True
    # Older torch needs the TP group registered for symmetric memory; newer torch (2.13 here)
    # registers groups itself and marks this call deprecated.
    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None and not getattr(enable, "__deprecated__", None):
        enable(tp_mesh.get_group().group_name)
    logger.info("async tensor parallel enabled (inductor micro-pipeline TP)")


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make a module's params replicated DTensors while its inputs/outputs stay plain tensors,
    so that foreach optimizer and norm kernels never see plain and DTensor params mixed."""
    distribute_module(
        module,
        mesh,
        # torch's stub types input_fn as returning None; distribute_module's pre-hook passes on what
        # it returns (torch/distributed/tensor/_api.py), the replicated DTensors here.
        input_fn=lambda _m, args, mesh: tuple(  # type: ignore[arg-type]
            DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args
        ),
        output_fn=lambda _m, out, _mesh: out.to_local(),
    )
