"""Document masking (model.attn_mask_type = "block_causal", torchtitan_amp/models/attention.py):
the document ids of a packed window, and a packed window that trains exactly as its documents
run one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.models import get_family
from torchtitan_amp.models.attention import MaskInputs, block_causal_mask, document_ids

BOS, EOS = 256, 257


def test_document_ids_start_at_bos_and_after_eos() -> None:
    # The window starts inside a document; a BOS after an EOS starts one document, not two; an EOS
    # without a BOS after it (a tokenizer that adds EOS only) still ends its document.
    tokens = torch.tensor([[7, 8, EOS, BOS, 1, 2, EOS, BOS, 3, EOS, 4, 5]])
    assert document_ids(tokens, BOS, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3]]
    mask = block_causal_mask(document_ids(tokens, BOS, EOS))
    assert mask.shape == (1, 1, 12, 12) and mask.dtype == torch.bool
    assert mask[0, 0, 5].tolist() == [False] * 3 + [True] * 3 + [False] * 6  # its document, up to itself
    assert mask[0, 0].diagonal().all()  # no empty row: SDPA would return NaN there


def test_causal_needs_no_inputs_and_an_unknown_type_is_refused() -> None:
    tokens = torch.tensor([[BOS, 1, EOS]])
    assert MaskInputs("causal", BOS, EOS)(tokens) == {}
    assert MaskInputs("block_causal", BOS, EOS)(tokens)["doc_ids"].tolist() == [[1, 1, 1]]
    with pytest.raises(
        ConfigError, match="'model.attn_mask_type' = 'sliding' is not allowed.*'causal', 'block_causal'"
    ):
        load_config(["--model.attn_mask_type", "sliding"])


def test_packed_window_loss_is_the_token_weighted_loss_of_its_documents_run_alone() -> None:
    """Rotary attention depends on relative positions only, so with document masking a document's
    tokens see exactly what they would see alone at positions 0..n: the packed window's mean loss
    equals the token-weighted mean of the documents' losses, and its gradients the sum of theirs,
    to fp32 rounding (measured: the losses agree below 2e-10 relative)."""
    torch.manual_seed(0)
    family = get_family("llama3")
    model = family.build_model(family.build_args("debugmodel_tiny", 258, 64))
    model.init_weights()
    docs = [torch.randint(0, 256, (n,)) for n in (5, 9, 3, 11)]
    window = torch.cat([torch.cat([torch.tensor([BOS]), d, torch.tensor([EOS])]) for d in docs])[None]
    inputs, labels = window[:, :-1], window[:, 1:]
    masks = MaskInputs("block_causal", BOS, EOS)

    def loss_and_grads(loss_sum: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        (loss_sum / labels.numel()).backward()
        return float(loss_sum) / labels.numel(), [p.grad.clone() for p in model.parameters()]

    packed, packed_grads = loss_and_grads(
        F.cross_entropy(model(inputs, **masks(inputs))[0], labels[0], reduction="sum")
    )
    ids = document_ids(inputs, BOS, EOS)[0]
    alone = sum(
        F.cross_entropy(model(inputs[:, ids == d])[0], labels[0, ids == d], reduction="sum") for d in ids.unique()
    )
    alone, alone_grads = loss_and_grads(alone)
    causal = float(F.cross_entropy(model(inputs)[0], labels[0]))
    assert len(ids.unique()) == 4
    assert packed == pytest.approx(alone, rel=1e-6)
    for got, want in zip(packed_grads, alone_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # The mask mattered: plain causal attention is off by far more than the bound above (measured
    # 4.6e-4 on these untrained weights, whose attention is nearly uniform, vs 1e-9 for the mask).
    assert abs(causal - packed) > 10 * 1e-6 * packed, (causal, packed)


def test_a_family_without_doc_ids_refuses_block_causal_in_one_line() -> None:
    import dataclasses

    from torch import nn

    from torchtitan_amp.train.job import check_mask_type

    class NoDocIds(nn.Module):
        def forward(self, tokens):  # type: ignore[no-untyped-def]
            return tokens

    llama = get_family("llama3")
    check_mask_type("block_causal", llama)  # Llama's forward takes doc_ids
    other = dataclasses.replace(llama, name="plain", model_cls=NoDocIds)
    check_mask_type("causal", other)
    with pytest.raises(ConfigError) as e:
        check_mask_type("block_causal", other)
    assert str(e.value) == (
        "'model.attn_mask_type' = 'block_causal' is not supported by model.name = 'plain' "
        "(its model's forward takes no doc_ids); use 'causal'"
    )
