"""Megatron-style tensor parallel (DTensor): a block's plan comes from its family, the decoder's ends
(embedding row-wise, output column-wise, final norm) are the same for every family; loss parallel and
async TP (inductor's micro-pipelining) are switched here."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from torchtitan_amp.config import JobConfig
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
            ParallelStyle for one block.
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
        parallelize_module(block, mesh, styles)
    if decoder.norm is not None and not sequence_parallel:
        _replicate_params(decoder.norm, mesh)
    logger.info(
        "applied tensor parallel (degree %d, sequence parallel %s, loss parallel %s)",
        mesh.size(),
        sequence_parallel,
        loss_parallel_on,
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
