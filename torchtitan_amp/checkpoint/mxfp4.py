"""MXFP4 tensors of Hugging Face checkpoints (gpt-oss's released experts) as plain tensors: e2m1
elements in blocks of 32 along the reduction dim, two 4-bit codes a byte (element 2i in the low
nibble), one E8M0 scale a block (2^(s - 127)). HF stores a weight [..., rows, cols] as
`*_blocks` [..., rows, cols / 32, 16] uint8 and `*_scales` [..., rows, cols / 32] uint8, and its
loader returns them transposed ([..., cols, rows]: the x @ W orientation of gpt-oss's experts),
as transformers.integrations.mxfp4.convert_moe_packed_tensors does; so does `dequantize`.

The decoding is the precision package's own (precision/lowbit/formats.py: unpack_e2m1,
e2m1_to_fp32, e8m0_to_fp32). Each value is a code of at most 2 significant bits times a power of
two: exact in fp32 (and in bf16 within its normal range), so the result equals transformers' bit
for bit. The checkpoint layer sits above precision/, so the import path can use it; models/
cannot, which is why this is here and not beside the family.
"""

from __future__ import annotations

import torch

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.precision.lowbit.formats import MX_BLOCK, e2m1_to_fp32, e8m0_to_fp32, unpack_e2m1

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def check_shapes(name: str, blocks: torch.Tensor, scales: torch.Tensor, expected: tuple[int, ...] | None) -> None:
    """Raise a one-line CheckpointError unless `blocks` / `scales` are MXFP4 of a weight shaped
    `expected` ([..., rows, cols], the stored orientation; None: any).

    Args:
        name: the tensor's HF name without the suffix, for the message.
        blocks: the `*_blocks` tensor.
        scales: the `*_scales` tensor.
        expected: the dequantized weight's shape before the transpose, or None.
    """
    want = (
        f" (a weight {list(expected)} is {[*expected[:-1], expected[-1] // MX_BLOCK, MX_BLOCK // 2]})"
        if expected
        else ""
    )
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(
            f"MXFP4 tensor '{name}': blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 3 or blocks.shape[-1] != MX_BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CheckpointError(
            f"MXFP4 tensor '{name}': {name}{BLOCKS_SUFFIX} {list(blocks.shape)} and {name}{SCALES_SUFFIX} "
            f"{list(scales.shape)} are not [..., rows, cols / 32, 16] and [..., rows, cols / 32]{want}"
        )
    got = (*blocks.shape[:-2], blocks.shape[-2] * MX_BLOCK)
    if expected is not None and got != tuple(expected):
        raise CheckpointError(
            f"MXFP4 tensor '{name}': {name}{BLOCKS_SUFFIX} {list(blocks.shape)} holds a weight {list(got)}, "
            f"the model's is {list(expected)}{want}"
        )


def dequantize(
    name: str,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    expected: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The MXFP4 weight as [..., cols, rows] in `dtype` (the last two dims transposed, as
    transformers' loader returns gpt-oss's experts).

    Args:
        name: the tensor's HF name without the suffix, for error messages.
        blocks: [..., rows, cols / 32, 16] uint8, two e2m1 codes a byte.
        scales: [..., rows, cols / 32] uint8 E8M0 exponents.
        expected: the weight's stored shape [..., rows, cols] to check against; None: any.
        dtype: the result's dtype (the values are exact in fp32; bf16 rounds only subnormals).
    """
    check_shapes(name, blocks, scales, expected)
    codes = unpack_e2m1(blocks)  # [..., rows, G, 32]
    values = e2m1_to_fp32(codes) * e8m0_to_fp32(scales).unsqueeze(-1)
    return values.flatten(-2).transpose(-2, -1).to(dtype)
