"""Context parallel in one process: the head-tail split, what a rank's model is handed, the mask
and rotary positions, the config-time refusals and the precision plan's CP decision.
tests/test_context_parallel_dist.py trains the layouts on real gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.distributed.context_parallel import (
    BatchSharder,
    attention_mask,
    check_seq_len,
    head_tail_positions,
)
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models import get_family
from torchtitan_amp.models.attention import MaskInputs, block_causal_mask, document_ids
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, Transformer
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.precision.report import context_parallel_summary

BOS, EOS = 256, 257


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_head_tail_split_covers_the_window_and_balances_causal_work(cp: int) -> None:
    seq = 32
    kept = [head_tail_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(kept).tolist()) == list(range(seq))
    assert all(len(k) == seq // cp for k in kept)
    # A query at position p attends to p + 1 keys: every rank gets the same number of pairs.
    assert len({int((k + 1).sum()) for k in kept}) == 1
    if cp == 2:
        assert kept[0].tolist() == [*range(0, 8), *range(24, 32)]
        assert kept[1].tolist() == list(range(8, 24))


def _batch(seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (3, seq + 1))
    tokens[:, 5], tokens[1, 11] = EOS, BOS
    return tokens[:, :-1], tokens[:, 1:]


def test_sharder_cuts_inputs_labels_and_document_ids_alike() -> None:
    inputs, labels = _batch()
    masks = MaskInputs("block_causal", BOS, EOS)
    docs = document_ids(inputs, BOS, EOS)
    for rank in range(2):
        x, y, extra = BatchSharder(masks, cp=2, cp_rank=rank)(inputs, labels)
        keep = head_tail_positions(16, 2, rank)
        assert torch.equal(x, inputs[:, keep]) and torch.equal(y, labels[:, keep])
        # Document ids of the whole window, then cut: a document starting on the other rank keeps its id.
        assert torch.equal(extra["doc_ids"], docs[:, keep])
        assert torch.equal(extra["positions"], keep.expand(3, -1))
    # cp = 1: the batch as it is, plus the mask inputs only.
    x, y, extra = BatchSharder(MaskInputs("causal", BOS, EOS))(inputs, labels)
    assert x is inputs and y is labels and extra == {}


def test_position_mask_is_the_block_causal_mask_on_a_whole_window() -> None:
    inputs, _ = _batch()
    docs = document_ids(inputs, BOS, EOS)
    pos = torch.arange(16).expand(3, -1)
    assert torch.equal(attention_mask(pos, pos, docs, docs), block_causal_mask(docs))
    assert torch.equal(attention_mask(pos, pos)[0, 0], torch.ones(16, 16, dtype=torch.bool).tril())


@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_model_given_positions_computes_each_token_as_in_its_window(mask_type: str) -> None:
    """Tokens handed out of order with their positions (what a cp rank holds, its keys and values
    being the whole window's) give each token the logits it has in order: rope and mask follow
    the positions, not the order."""
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel_tiny"], max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    inputs, _ = _batch()
    extra = MaskInputs(mask_type, BOS, EOS)(inputs)
    reference = model(inputs, **extra)
    order = torch.cat([head_tail_positions(16, 2, 1), head_tail_positions(16, 2, 0)])
    shuffled = model(inputs[:, order], positions=order.expand(3, -1), **{k: v[:, order] for k, v in extra.items()})
    torch.testing.assert_close(shuffled, reference[:, order], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Config-time refusals, one line each


def test_seq_len_must_split_into_two_chunks_per_cp_rank() -> None:
    check_seq_len(32, 4)
    check_seq_len(33, 1)
    with pytest.raises(ConfigError) as e:
        check_seq_len(36, 4)
    assert str(e.value) == (
        "'training.seq_len' = 36 must be divisible by 2 x context_parallel_degree = 8 "
        "(each cp rank holds two of 2 x cp equal chunks of a sequence)"
    )


def test_layout_checks_seq_len_per_cp_and_tp_rank() -> None:
    from torchtitan_amp.train.parallelize import validate_layout

    def validate(*argv: str, world: int) -> None:
        config = load_config(list(argv))
        validate_layout(ParallelDims.from_config(config.parallelism, world), config, 8, 8, 4, "cpu")

    validate("--parallelism.context_parallel_degree", "2", "--training.seq_len", "32", world=2)
    with pytest.raises(ConfigError, match="'training.seq_len' = 30 must be divisible by 2 x"):
        validate("--parallelism.context_parallel_degree", "2", "--training.seq_len", "30", world=2)
    # Sequence parallel splits a cp rank's S / cp tokens over tp: 36 / 2 = 18 is not a multiple of 4.
    with pytest.raises(ConfigError) as e:
        validate(
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "4",
            "--training.seq_len",
            "36",
            world=8,
        )
    assert "'training.seq_len' = 36 / context_parallel_degree 2 must be divisible by tensor_parallel_degree = 4" in str(
        e.value
    ) and "\n" not in str(e.value)


def test_validation_windows_split_like_training_windows() -> None:
    from torchtitan_amp.eval.validation import resolve_spec

    config = load_config(
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--validation.enable",
            "true",
            "--validation.seq_len",
            "18",
            "--training.seq_len",
            "32",
        ]
    )
    with pytest.raises(
        ConfigError, match="'validation.seq_len' = 18 must be divisible by 2 x context_parallel_degree = 4"
    ):
        resolve_spec(config, 32, None)


def test_family_without_positions_is_refused_for_cp() -> None:
    from torch import nn

    from torchtitan_amp.train.job import check_mask_type

    class NoPositions(nn.Module):
        def forward(self, tokens, doc_ids=None):  # type: ignore[no-untyped-def]
            return tokens

    check_mask_type("causal", get_family("llama3"), cp=2)
    other = dataclasses.replace(get_family("llama3"), name="plain", model_cls=NoPositions)
    check_mask_type("block_causal", other, cp=1)
    with pytest.raises(ConfigError) as e:
        check_mask_type("causal", other, cp=2)
    assert str(e.value) == (
        "'parallelism.context_parallel_degree' = 2 is not supported by model.name = 'plain' "
        "(its model's forward takes no positions); use 1"
    )


def test_degree_below_one_is_refused_at_parse_time() -> None:
    with pytest.raises(ConfigError, match="'parallelism.context_parallel_degree' must be >= 1, got 0"):
        load_config(["--parallelism.context_parallel_degree", "0"])


# ---------------------------------------------------------------------------------------------
# The plan decides CP's precision


def _plan(*argv: str, cp: int = 2) -> PrecisionPlan:
    dims = ParallelDims(1, 1, 1, 1, cp, cp)
    return PrecisionPlan.from_config(load_config(list(argv)), dims, "cpu", probe=None)


def test_cp_takes_the_fsdp_path_and_reduces_kv_gradients_in_fp32_by_default() -> None:
    dims = ParallelDims(1, 1, 1, 1, 2, 2)
    assert dims.fsdp_enabled and dims.fsdp_shard == 2 and not dims.ddp_enabled and dims.dp_degree == 1
    plan = _plan("--mixed_precision.enabled", "true")
    assert plan.path == "fsdp" and plan.cp_reduce_dtype == torch.float32
    assert context_parallel_summary(plan) == {
        "degree": 2,
        "kv_all_gather_dtype": "bfloat16",
        "kv_grad_reduce_scatter_dtype": "float32",
        "softmax_merge": "none: each rank's queries attend to the all-gathered keys and values in one SDPA "
        "call (no partial outputs or log-sum-exps to merge)",
    }
    assert (
        _plan("--mixed_precision.enabled", "true", "--mixed_precision.cp_reduce_dtype", "bfloat16").cp_reduce_dtype
        == torch.bfloat16
    )
    # fp32 training: everything, the cp reduction included, in fp32.
    off = _plan("--mixed_precision.enabled", "false", "--mixed_precision.cp_reduce_dtype", "bfloat16")
    assert off.cp_reduce_dtype == torch.float32 and context_parallel_summary(off)["kv_all_gather_dtype"] == "float32"


def test_cp_reduce_dtype_without_cp_is_noted_and_fp16_under_bf16_refused() -> None:
    plan = _plan("--mixed_precision.enabled", "true", "--mixed_precision.cp_reduce_dtype", "bfloat16", cp=1)
    assert context_parallel_summary(plan) is None
    assert any("cp_reduce_dtype has no effect" in note for note in plan.notes)
    with pytest.raises(PrecisionError, match="'mixed_precision.cp_reduce_dtype' = 'float16' with param_dtype"):
        _plan("--mixed_precision.enabled", "true", "--mixed_precision.cp_reduce_dtype", "float16")


@pytest.mark.parametrize("cp, rank", [(2, 0), (2, 1), (4, 2)])
def test_causal_chunks_attend_as_the_position_mask(cp: int, rank: int) -> None:
    """Causal CP attends each of a rank's two query chunks to the window's keys up to its end
    (a lower-right causal bias, no mask tensor): the same as one call with the position mask."""
    from torchtitan_amp.distributed.context_parallel import ContextParallel, gathered_positions

    Rank = type("Rank", (ContextParallel,), {"degree": cp, "rank": rank})

    seq = 32
    torch.manual_seed(0)
    q = torch.randn(2, 3, seq // cp, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, seq, 8, dtype=torch.float64), torch.randn(2, 3, seq, 8, dtype=torch.float64)
    pos = head_tail_positions(seq, cp, rank).expand(2, -1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attention_mask(pos, torch.arange(seq).expand(2, -1))
    )
    got = Rank(group=None).causal_attention(q, k, v)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # The gathered keys arrive rank by rank; to_window_order puts them back at their positions.
    gathered = gathered_positions(seq, cp)
    assert torch.equal(
        Rank(group=None).to_window_order(gathered.view(1, -1, 1, 1)).flatten(),  # type: ignore[arg-type]
        torch.arange(seq),
    )
