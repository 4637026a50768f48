"""The Llama sizes people download: Llama 3.2 1B / 3B (rope scaling factor 32, tied
embeddings) and Llama 3 (3.0) 8B / 70B (no rope scaling) as flavors whose published config.json
files import under their names, checked on the published configs themselves (written here from
their published values: no download) and, where the real sizes are too big, on the meta device
and the memory model. tests/test_weight_tying.py round-trips shrunk copies through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchtitan_amp.checkpoint.hf import CONFIG, check_config, hf_config
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.core.rules import FAMILIES
from torchtitan_amp.memory import ModelDims
from torchtitan_amp.models import count_params, get_family
from torchtitan_amp.models.llama3.hf import ADAPTER
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, Transformer, build_model_args, flops_per_token

VOCAB = 128256  # Llama 3's tiktoken vocabulary: 128000 BPE tokens + 256 special

_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "model_type": "llama",
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB,
}
_LLAMA_3_2 = {
    **_COMMON,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "transformers_version": "4.45.0.dev0",
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
_LLAMA_3_0 = {
    **_COMMON,
    "max_position_embeddings": 8192,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.40.0.dev0",
}

# config.json of meta-llama/Llama-3.2-1B, Llama-3.2-3B, Meta-Llama-3-8B, Meta-Llama-3-70B as published.
PUBLISHED: dict[str, dict] = {
    "llama3_2_1b": {
        **_LLAMA_3_2,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
    "llama3_2_3b": {
        **_LLAMA_3_2,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    "llama3_0_8b": {
        **_LLAMA_3_0,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama3_0_70b": {
        **_LLAMA_3_0,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}
# Parameters as the model cards state them (1.24B, 3.21B, 8.03B, 70.6B), exactly; a tied table
# counted once.
PUBLISHED_PARAMS = {
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "llama3_0_8b": 8_030_261_248,
    "llama3_0_70b": 70_553_706_496,
}


def _independent_count(cfg: dict) -> int:
    """From config.json alone: embeddings (twice unless tied), per layer q/k/v/o, SwiGLU, 2 norms,
    the final norm."""
    d, f, heads, kv = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    kv_dim = kv * d // heads
    layer = 2 * d * d + 2 * d * kv_dim + 3 * d * f + 2 * d
    tables = 1 if cfg["tie_word_embeddings"] else 2
    return cfg["num_hidden_layers"] * layer + tables * cfg["vocab_size"] * d + d


def _write(folder: Path, cfg: dict) -> Path:
    (folder / CONFIG).write_text(json.dumps(cfg))
    return folder


def test_the_flavors_are_listed_without_torch() -> None:
    """rules.FAMILIES (the torch-free list config parsing and --help read) names every flavor."""
    assert set(PUBLISHED) <= set(FAMILIES["llama3"]) <= set(LLAMA3_FLAVORS)


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_config_loads_under_its_flavor(flavor: str, tmp_path: Path) -> None:
    """The config check checkpoint.initial_load_path runs: the published config.json fits its
    flavor (tying, rope scaling 32 or none, FFN width included) and no other new flavor."""
    folder = _write(tmp_path, PUBLISHED[flavor])
    check_config(folder, build_model_args(flavor, VOCAB, 8192), flavor)
    fields = ADAPTER.config_fields(PUBLISHED[flavor], folder)
    args = LLAMA3_FLAVORS[flavor]
    assert fields["enable_weight_tying"] == args.enable_weight_tying == (flavor.startswith("llama3_2"))
    assert fields["use_scaled_rope"] == args.use_scaled_rope
    if args.use_scaled_rope:
        assert (fields["rope_scaling_factor"], args.rope_scaling_factor) == (32.0, 32.0)
    for other in set(PUBLISHED) - {flavor}:
        with pytest.raises(CheckpointError) as e:
            check_config(folder, build_model_args(other, VOCAB, 8192), other)
        assert "\n" not in str(e.value) and f"model.flavor '{other}'" in str(e.value)


def test_3_1_and_3_0_are_told_apart_by_rope_scaling(tmp_path: Path) -> None:
    """Llama 3 8B and 3.1 8B have the same shapes: only rope scaling tells them apart."""
    folder = _write(tmp_path, PUBLISHED["llama3_0_8b"])
    with pytest.raises(
        CheckpointError,
        match=r"'rope_scaling' = none but model.flavor 'llama3_8b' has "
        r"use_scaled_rope = True",
    ):
        check_config(folder, build_model_args("llama3_8b", VOCAB, 8192), "llama3_8b")


def test_tying_is_checked_one_way(tmp_path: Path) -> None:
    """A tied flavor cannot hold an untied folder's two matrices: one line naming the field. An
    untied flavor may start from a tied folder (its output begins as a copy of the table)."""
    untied = _write(tmp_path, {**PUBLISHED["llama3_2_1b"], "tie_word_embeddings": False})
    with pytest.raises(
        CheckpointError,
        match=r"'tie_word_embeddings' = False but model.flavor 'llama3_2_1b' "
        r"has enable_weight_tying = True",
    ) as e:
        check_config(untied, build_model_args("llama3_2_1b", VOCAB, 8192), "llama3_2_1b")
    assert "\n" not in str(e.value)
    tied_8b = _write(tmp_path, {**PUBLISHED["llama3_0_8b"], "tie_word_embeddings": True})
    check_config(tied_8b, build_model_args("llama3_0_8b", VOCAB, 8192), "llama3_0_8b")


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_exported_config_matches_the_published_one(flavor: str, tmp_path: Path) -> None:
    """What `export --format hf` writes for the flavor describes the same model as the published
    config.json: every field a Llama loader reads, tying and rope scaling included."""
    args = build_model_args(flavor, VOCAB, 8192)
    ours = hf_config(args, "bfloat16", 128000, 128001)
    published = PUBLISHED[flavor]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "hidden_act",
        "model_type",
    ):
        assert ours[key] == published[key], key
    check_config(_write(tmp_path, ours), args, flavor)


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_param_counts_match_published(flavor: str) -> None:
    """Built on the meta device, the memory model and config.json agree on the published count, a
    tied table once; MFU's N (the 6N rule) keeps a tied table, whose output matmul still runs,
    and drops an untied embedding table, which only serves lookups."""
    cfg, published = PUBLISHED[flavor], PUBLISHED_PARAMS[flavor]
    assert _independent_count(cfg) == published
    args = build_model_args(flavor, VOCAB, 8192)
    with torch.device("meta"):
        model = Transformer(args)
    dims = get_family("llama3").memory_dims(args)
    assert count_params(model) == dims.total_params() == published
    table = VOCAB * cfg["hidden_size"]
    n_flops = published if cfg["tie_word_embeddings"] else published - table
    assert count_params(model, exclude_embedding=True) == dims.matmul_params() == n_flops
    assert isinstance(dims, ModelDims) and dims.tied == cfg["tie_word_embeddings"]
    assert (
        flops_per_token(args, n_flops, 8192) == 6 * n_flops + 12 * args.n_layers * args.n_heads * args.head_dim * 8192
    )
    # One key per tensor: a tied table is saved, exported and imported as tok_embeddings.weight.
    keys = model.state_dict().keys()
    assert ("output.weight" in keys) != cfg["tie_word_embeddings"] and "tok_embeddings.weight" in keys


@pytest.mark.parametrize(
    "degrees",
    [
        ("--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2"),
        ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "8"),
    ],
)
def test_dry_run_of_the_tied_1b_matches_the_memory_model(degrees: tuple[str, ...]) -> None:
    """On 8 simulated ranks (fake backend, meta model), FSDP 4 x TP 2 and DDP 8: the state bytes,
    FSDP groups and communication the real (tied) model has are the memory model's, which counts
    the table once, as a Linear (bf16 all-gather with the output, one gradient)."""
    from torchtitan_amp import memory
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import dry_run

    config = load_config(
        [
            "--model.flavor",
            "llama3_2_1b",
            "--training.seq_len",
            "2048",
            "--dry_run.vocab_size",
            str(VOCAB),
            "--job.dump_folder",
            "unused",
            *degrees,
        ]
    )
    report = dry_run.run(config, world_size=8, write=False)
    res, c = dry_run.resolve(config, 8), report["coordinates"]
    assert report["model"]["total_params"] == PUBLISHED_PARAMS["llama3_2_1b"]
    assert report["memory"]["analytic_state_matches"]
    analytic = sorted(
        (
            s.index,
            g.name,
            g.kind,
            g.unsharded_numel(res.layout.fsdp_shard),
            g.gather_dtype,
            g.reduce_dtype,
            g.reshard_after_forward,
        )
        for s in memory.rank_stages(res.model_dims, res.layout, c["pp"])
        for g in memory.fsdp_groups(res.model_dims, res.precision, res.layout, s, c["tp"])
    )
    assert sorted(tuple(g.values()) for g in report["fsdp_groups"]) == (analytic if res.dims.fsdp_enabled else [])
    assert (
        memory.comm(res.model_dims, res.precision, res.layout, pp_rank=c["pp"], tp_rank=c["tp"])
        == report["communication"]
    )
