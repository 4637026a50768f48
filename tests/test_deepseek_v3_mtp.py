"""DeepSeek-V3's multi-token prediction beyond its formula (tests/test_deepseek_v3.py): the
layouts it refuses, document boundaries under block-causal packing, and its memory terms. Its
FSDP 2, EP 2, TP 2 and PP 2 runs against one process: tests/test_moe_dist.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_deepseek_v3 import ARGS, MTP_RTOL, TOKENS
from torchtitan_amp.config import ConfigError
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models.deepseek_v3.model import DEEPSEEK_V3_FLAVORS, DeepSeekV3Transformer
from torchtitan_amp.train.parallelize import check_mtp

MTP_FLAVOR = DEEPSEEK_V3_FLAVORS["debugmodel_mtp"]


@pytest.mark.parametrize(
    "dims,option,why",
    [
        (ParallelDims(1, 1, 1, 1, 2, cp=2), "context_parallel_degree", "depth k shifts each sequence"),
    ],
)
def test_mtp_refuses_cp_in_one_line(dims, option, why):
    with pytest.raises(ConfigError) as e:
        check_mtp(MTP_FLAVOR, dims, "debugmodel_mtp")
    message = str(e.value)
    assert "\n" not in message and f"'parallelism.{option}' = 2 cannot train model.flavor 'debugmodel_mtp'" in message
    assert "runs on FSDP, HSDP, DDP, EP, TP and PP" in message and why in message, message


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(1, 2, 1, 1, 2),
        ParallelDims(2, 2, 1, 1, 4),
        ParallelDims(2, 1, 1, 1, 2),
        ParallelDims(1, 2, 1, 1, 2, ep=2),
        ParallelDims(1, 1, 2, 1, 2),
        ParallelDims(1, 2, 2, 1, 4),
        ParallelDims(1, 1, 1, 2, 2),
        ParallelDims(1, 1, 2, 2, 4),
    ],
)
def test_mtp_runs_on_data_expert_tensor_and_pipeline_parallel(dims):
    """FSDP, HSDP, DDP, EP, TP and PP take it (FSDP 2, EP 2, TP 2 and PP 2 trained against one
    process in tests/test_moe_dist.py); without MTP nothing is refused."""
    check_mtp(MTP_FLAVOR, dims, "debugmodel_mtp")
    check_mtp(DEEPSEEK_V3_FLAVORS["debugmodel"], ParallelDims(1, 1, 2, 2, 4, cp=1), "debugmodel")


def _mtp_sum(model, tokens, labels, doc_ids=None):  # type: ignore[no-untyped-def]
    model(tokens, doc_ids=doc_ids, labels=labels)
    return model.pop_mtp_loss()


def test_mtp_targets_stay_in_their_document():
    """Two documents packed in one window under document masking (doc_ids): the MTP loss (depth 2)
    is the sum of each document's alone, where a depth's targets end with the document. A target in
    the other document (the first tokens of the second, predicted from the first's last positions)
    would add terms (2 of depth 1, 3 of depth 2: measured 5.6% more loss without the rule); with it
    the two agree to 0.0 on this CPU (block-causal attention and relative rotary positions).
    """
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(dataclasses.replace(ARGS, mtp_depth=2))
    model.init_weights()
    first, second = TOKENS[:1, :20], TOKENS[1:, :28]
    packed = torch.cat([first, second], dim=1)
    doc_ids = torch.cat([torch.zeros(1, 20), torch.ones(1, 28)], dim=1).int()

    def labels(tokens: torch.Tensor) -> torch.Tensor:  # the next tokens, none after the window
        return torch.cat([tokens[:, 1:], torch.full((1, 1), -100)], dim=1)

    with torch.no_grad():
        together = _mtp_sum(model, packed, labels(packed), doc_ids)
        alone = _mtp_sum(model, first, labels(first)) + _mtp_sum(model, second, labels(second))
    error = abs(together.item() - alone.item()) / alone.item()
    print(f"packed MTP loss {together.item():.6f}, documents alone {alone.item():.6f}, rel {error:.2e}")
    assert error < MTP_RTOL


def test_mtp_labels_ignore_other_documents():
    """Depth k's targets: labels[i + k], ignored where token i + k + 1 is in another document than
    token i; the last label (the token after the window) counts as the last token's document."""
    from torchtitan_amp.models.deepseek_v3.model import mtp_labels

    labels = torch.arange(10, 16).view(1, 6)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert mtp_labels(labels, docs, 1).tolist() == [[11, -100, -100, 14, 15]]
    assert mtp_labels(labels, docs, 2).tolist() == [[-100, -100, -100, 15]]
    assert mtp_labels(labels, None, 2).tolist() == [[12, 13, 14, 15]]


def _saved_by_mtp(precision: str, s: int, b: int):  # type: ignore[no-untyped-def]
    """(bytes autograd saves in a labelled forward with one dense MTP depth minus without it, the
    memory model's MTP bytes for that microbatch on this CPU)."""
    import functools

    from tests.test_memory_moe import _saved_bytes
    from torchtitan_amp import memory
    from torchtitan_amp.config import load_config
    from torchtitan_amp.models.deepseek_v3 import FAMILY
    from torchtitan_amp.precision import PrecisionPlan, autocast, memory_spec

    enabled = "false" if precision == "fp32" else "true"
    config = load_config(["--model.name", "deepseek_v3", "--mixed_precision.enabled", enabled])
    plan = PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu")
    tokens, labels = torch.randint(0, 258, (2, b, s), generator=torch.Generator().manual_seed(0))
    measured = []
    # Two dense layers and a dense depth: the routed blocks' bytes vary with the routing.
    base = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], n_layers=2, n_dense_layers=3, max_seq_len=s)
    for depth in (0, 1):
        torch.manual_seed(0)
        model = FAMILY.build_model(dataclasses.replace(base, mtp_depth=depth))
        model.init_weights()
        autocast.apply_fp32_islands(plan, model)
        forward = functools.partial(model, labels=labels)
        forward.parameters = model.parameters  # type: ignore[attr-defined]  # what _saved_bytes skips
        measured.append(_saved_bytes(forward, tokens, functools.partial(autocast.forward_context, plan)))
    args, spec = dataclasses.replace(base, mtp_depth=1), memory_spec.from_plan(plan, FAMILY.norm_cls)
    dims = FAMILY.memory_dims(args)
    layout = memory.Layout(seq_len=s, local_batch_size=b)
    # CPU's attention beyond a GPU's, on the depth's window of s - 1 positions (as for a layer).
    cpu = dims.activation_terms(spec, memory.Layout(seq_len=s - 1, local_batch_size=b)).layer_cpu
    formula = dims.mtp_bytes(spec, layout) * layout.microbatch_tokens + cpu * b * (s - 1)
    return measured[1] - measured[0], formula


@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16"])
def test_mtp_activation_formula_matches_saved_tensors(precision):
    """One dense MTP depth's saved-for-backward bytes (a labelled forward with it minus one
    without) equal the memory model's (MLADims.mtp_bytes, which the last stage's head term adds,
    and so the dry run) to the byte, but for cross-entropy's 4-byte total weight per depth."""
    measured, formula = _saved_by_mtp(precision, s=40, b=3)
    print(f"{precision}: one MTP depth saves {measured} B, formula {formula:.0f} B")
    assert measured - formula == 4


def test_flops_count_the_mtp_depth_as_a_routed_block_and_a_head():
    """The 671B flavor's published depth adds to a token's FLOPs one routed block's active
    parameters (8 of its 256 experts), eh_proj, the shared head run again and one block's attention,
    x 6; not its unused experts (11.3B parameters, a quarter of the model's active ones)."""
    from torchtitan_amp.models.deepseek_v3.model import DeepSeekV3Transformer, flops_per_token
    from torchtitan_amp.models.spec import count_params

    with_mtp = DEEPSEEK_V3_FLAVORS["deepseek_v3_671b"]
    without = dataclasses.replace(with_mtp, mtp_depth=0)
    n = {}
    for args in (with_mtp, without):
        with torch.device("meta"):
            model = DeepSeekV3Transformer(args)
        n[args.mtp_depth] = count_params(model) - model.tok_embeddings.weight.numel()
    a, s = with_mtp, 4096
    unused = (a.n_routed_experts - a.top_k) * 3 * a.dim * a.moe_inter_dim
    attention = 6 * a.n_heads * (a.head_dim + a.v_head_dim) * s
    want = 6 * (n[1] - n[0] - unused + a.dim * a.vocab_size) + attention
    assert flops_per_token(with_mtp, n[1], s) - flops_per_token(without, n[0], s) == want


# deepseek-ai/DeepSeek-V3's config.json as published (its fp8 quantization_config aside: the
# block-scaled fp8 weights are another question than the shape).
PUBLISHED_671B = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_published_671b_config_fits_the_flavor(tmp_path):
    """The published config.json (num_nextn_predict_layers 1) describes deepseek_v3_671b exactly."""
    import json

    from torchtitan_amp.checkpoint.hf import CONFIG, check_config

    (tmp_path / CONFIG).write_text(json.dumps(PUBLISHED_671B))
    args = DEEPSEEK_V3_FLAVORS["deepseek_v3_671b"]
    check_config(tmp_path, dataclasses.replace(args, max_seq_len=4096), "deepseek_v3_671b")


def test_compiled_mtp_depth_on_flex_equals_eager_sdpa() -> None:
    """The depth's S - k queries get their BlockMask before its compiled block runs (a compiled
    block only looks masks up): MTP with document masking on flex, blocks compiled (aot_eager,
    fullgraph), gives SDPA's logits and MTP loss within the fp32 reorderings of the sums."""
    from torchtitan_amp.distributed.compile import apply_compile

    torch.manual_seed(0)
    model = DeepSeekV3Transformer(DEEPSEEK_V3_FLAVORS["debugmodel_mtp"])
    model.init_weights()
    tokens, labels = torch.randint(0, 258, (2, 32)), torch.randint(0, 258, (2, 32))
    doc_ids = torch.zeros(2, 32, dtype=torch.long)
    doc_ids[:, 13:] = 1
    with torch.no_grad():
        logits = model(tokens, doc_ids=doc_ids, labels=labels)
        mtp_loss = model.mtp_loss.clone()
        model.attention_backend = "flex"
        apply_compile(model, fullgraph=True, backend="aot_eager")
        flex_logits = model(tokens, doc_ids=doc_ids, labels=labels)
    torch.testing.assert_close(flex_logits, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.mtp_loss, mtp_loss, rtol=MTP_RTOL, atol=0)
