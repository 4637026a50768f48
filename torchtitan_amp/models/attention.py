"""Which tokens a token may attend to (`model.attn_mask_type`), shared by every model family.

"causal": every earlier token of the window. "block_causal" (document masking): only the earlier
tokens of its own document, so that packed windows train as if each document were alone; the
boundaries come from the tokens themselves (a BOS starts a document, so does the token after an
EOS), whatever the dataset kind. The mask is handed to SDPA as a boolean tensor: it runs on CPU and
CUDA alike (FlexAttention has no CPU backward in torch 2.13), at the cost of one B x S x S bool per
forward and, on CUDA, SDPA's memory-efficient kernel instead of flash.
"""

from __future__ import annotations

import contextlib

import torch

from torchtitan_amp.core.rules import SDPA_PRIORITY


def document_ids(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """[B, S] ids -> [B, S] int32: per token, which document of its window it belongs to (0 for the
    part of a document the window starts in).

    Args:
        tokens: the token ids [B, S].
        bos_id: the tokenizer's beginning-of-sequence id (a document starts at it).
        eos_id: the tokenizer's end-of-sequence id (a document ends with it).
    """
    starts = tokens == bos_id
    starts[:, 1:] |= tokens[:, :-1] == eos_id
    return starts.cumsum(dim=1, dtype=torch.int32)


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> [B, 1, S, S] bool (True: may attend), broadcast over heads. Every
    token sees itself, so no row is empty (SDPA would return NaN for it)."""
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


class MaskInputs:
    """The extra forward arguments a job's mask type needs: none for "causal", `doc_ids` for
    "block_causal". Computed from the input tokens on every rank (pipeline stages past the first
    see hidden states, not tokens, so the trainer hands them the ids)."""

    def __init__(self, mask_type: str, bos_id: int, eos_id: int) -> None:
        # mask_type comes from the config, whose Literal already refused any other value.
        self.mask_type, self.bos_id, self.eos_id = mask_type, bos_id, eos_id

    def __call__(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.mask_type == "causal":
            return {}
        return {"doc_ids": document_ids(tokens, self.bos_id, self.eos_id)}


def pinned_kernels() -> contextlib.AbstractContextManager[object]:
    """The SDPA backends and their order (rules.SDPA_PRIORITY: flash, efficient, math; cuDNN
    attention off) around a model's attention call, so that what runs is what rules.attention_kernel
    says (torch would put cuDNN first on sm90 / sm100). torch.compile traces it (torch 2.9+)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_PRIORITY], set_priority=True)


def cuda_capability() -> tuple[int, int] | None:
    """This process's CUDA device's compute capability, or None without one; read when a model
    is built (eager), kept on its attention modules, so that a compiled forward reads a constant."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None  # type: ignore[return-value]
