"""Which tokens a token may attend to (`model.attn_mask_type`), shared by every model family.

"causal": every earlier token of the window. "block_causal" (document masking): only the earlier
tokens of its own document, so that packed windows train as if each document were alone; the
boundaries come from the tokens themselves (a BOS starts a document, so does the token after an
EOS), whatever the dataset kind. The mask is handed to SDPA as a boolean tensor: it runs on CPU and
CUDA alike (FlexAttention has no CPU backward in torch 2.13), at the cost of one B x S x S bool per
forward and, on CUDA, SDPA's memory-efficient kernel instead of flash.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """[B, S] ids -> [B, S] int32: per token, which document of its window it belongs to (0 for the
    part of a document the window starts in)."""
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
