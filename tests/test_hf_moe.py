"""Hugging Face interop of the MoE family (models/moe/hf.py through checkpoint/hf.py), checked
against transformers' own Qwen3MoeForCausalLM: a tiny random one (a dense first block, then MoE
blocks of 8 experts top 2 with renormalised weights, QK-norm, GQA, an explicit head_dim twice
hidden / heads, random norm weights so that the q/k-norm permutation matters), saved in small
shards, half of one layer's experts moved to a shard of their own so that one stacked weight of
ours spans several files. Import gives transformers' logits on
one process, through the trainer, and on FSDP 2 / TP 2 / PP 2; an export of a run trained from it
loads in transformers with no missing or unexpected keys and gives our logits; export -> reimport
is bit for bit; config.json round-trips; what Qwen3-MoE cannot say is refused in one line. The
dense Qwen3 family's import (tests/test_qwen3.py's folder) joins the launch on FSDP 2 and TP 2,
DeepSeek-V3's (tests/test_deepseek_v3.py's) and gpt-oss's (tests/test_gpt_oss_hf.py's) on FSDP 2,
TP 2 and EP 2, gpt-oss's also on TP 2 with FlexAttention (forward only: CPU).

Run as a script, this file is tests/workers/ckpt_jobs.py with this file's flavor registered (the
worker knows only Llama flavors).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.hf import HFExport
from tests.support.launch import ONE_THREAD, WORKERS, run_python, spawn_ranks, write_spec
from torchtitan_amp.checkpoint.format import quiet_single_process
from torchtitan_amp.checkpoint.hf import CONFIG, INDEX, check_config, hf_config, load_hf, to_hf_tensors
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.moe import FAMILY
from torchtitan_amp.models.moe.model import MOE_FLAVORS, MoEModelArgs, MoETransformer

pytestmark = pytest.mark.dist

FLAVOR = "qwen3_moe_hf_test"
ARGS = MoEModelArgs(
    dim=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    explicit_head_dim=32,
    vocab_size=258,
    max_seq_len=32,
    norm_eps=1e-6,
    rope_theta=1_000_000.0,
    use_scaled_rope=False,
    n_routed_experts=8,
    top_k=2,
    moe_inter_dim=32,
    route_norm=True,
    qk_norm=True,
    n_dense_layers=1,
    dense_inter_dim=96,
    load_balance="aux_loss",
)
TOKENS = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(7))
# fp32, max |ours - transformers| over all logits; the logits' own scale is ~1 (printed by
# test_import_matches_transformers_on_one_process), so this is also ~1e-5 relative.
LOGITS_ATOL = 1e-5
STEPS = 3


def _hf_config(**changes):  # type: ignore[no-untyped-def]
    from transformers import Qwen3MoeConfig

    fields = dict(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    return Qwen3MoeConfig(**{**fields, **changes})


HF_EXPORT = HFExport(
    "Qwen3MoeForCausalLM",
    _hf_config,
    TOKENS,
    max_shard_size="20KB",  # conftest.py's `hf`
    perturb_norms=True,
    own_shard=r"model\.layers\.1\.mlp\.experts\.[4-7]\.",
)


def _ours(folder: Path, args: MoEModelArgs = ARGS) -> MoETransformer:
    model = MoETransformer(args)
    model.init_weights()
    load_hf(model, folder, args, complete_model=True, family=FAMILY)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def test_published_layout_is_what_transformers_saves(hf):
    """transformers 5 fuses the experts in memory (gate_up_proj [E, 2h, d]) but saves them per
    expert, as the published checkpoints are; that is the layout we read and write."""
    names = set(json.loads((hf[0] / INDEX).read_text())["weight_map"])
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.self_attn.q_norm.weight" in names
    assert not any("gate_up_proj" in n for n in names)


def test_import_matches_transformers_on_one_process(hf):
    folder, _, reference = hf
    ours = _ours(folder)
    got = _logits(ours)
    error = (got - reference).abs().max().item()
    print(f"max |logit| {reference.abs().max().item():.3f}, max abs error {error:.3g}")
    assert error <= LOGITS_ATOL
    assert torch.count_nonzero(ours.layers["1"].feed_forward.router.expert_bias) == 0
    # What the import must get right shows: without renormalised top-k weights, or with the
    # q/k norms left in HF's element order, the logits are far off.
    unnormed = MoETransformer(dataclasses.replace(ARGS, route_norm=False))
    unnormed.load_state_dict(ours.state_dict())
    assert (_logits(unnormed.eval()) - reference).abs().max() > 100 * LOGITS_ATOL
    sd = ours.state_dict()
    for layer in range(ARGS.n_layers):
        sd[f"layers.{layer}.attention.q_norm.weight"] = hf[1].model.layers[layer].self_attn.q_norm.weight.detach()
    ours.load_state_dict(sd)
    assert (_logits(ours) - reference).abs().max() > 100 * LOGITS_ATOL


def _job(dump: Path, hf_folder: Path, *extra: str) -> list[str]:
    return [
        "--model.name",
        "moe",
        "--model.flavor",
        FLAVOR,
        "--model.tokenizer",
        "byte",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--mixed_precision.enabled",
        "false",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(hf_folder),
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def test_import_through_the_trainer_on_one_process(hf, tmp_path, monkeypatch):
    """checkpoint.initial_load_path = the folder, with config.json checked against the flavor."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import trainer as trainer_module

    monkeypatch.setitem(MOE_FLAVORS, FLAVOR, ARGS)
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)  # MFU is not read here
    trainer = trainer_module.Trainer(load_config(_job(tmp_path, hf[0])))
    try:
        assert (_logits(trainer.run.model.eval()) - hf[2]).abs().max() <= LOGITS_ATOL
    finally:
        trainer.run.metrics.close()


LAYOUTS = {
    "fsdp": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "pp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
}


# The dense Qwen3 family's import (tests/test_qwen3.py's untied folder) joins this launch on FSDP 2
# and TP 2 (q/k norms split by head).
QWEN3_LAYOUTS = ("fsdp", "tp")


@pytest.fixture(scope="module")
def qwen3_hf(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(folder, model, logits of TOKENS) of tests/test_qwen3.py's untied Qwen3ForCausalLM."""
    from tests import test_qwen3
    from tests.support.hf import save_hf_export

    return save_hf_export(test_qwen3.EXPORTS[False], tmp_path_factory.mktemp("qwen3_hf"))


def _qwen3_job(dump: Path, hf_folder: Path, *extra: str) -> list[str]:
    from tests import test_qwen3

    args = _job(dump, hf_folder, *extra)
    args[args.index("moe")], args[args.index(FLAVOR)] = "qwen3", test_qwen3.FLAVOR
    return args


# DeepSeek-V3 (tests/test_deepseek_v3.py's folder) and gpt-oss (tests/test_gpt_oss_hf.py's random
# GptOssForCausalLM) join this launch on FSDP 2, TP 2 and EP 2 (FSDP 2 with the experts split).
FAMILY_LAYOUTS = {
    **{k: LAYOUTS[k] for k in QWEN3_LAYOUTS},
    "ep": [*LAYOUTS["fsdp"], "--parallelism.expert_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def deepseek_v3_hf(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(folder, model, logits of test_deepseek_v3.TOKENS) of tests/test_deepseek_v3.py's model."""
    from tests import test_deepseek_v3

    return test_deepseek_v3.save_hf(tmp_path_factory.mktemp("deepseek_v3_hf"))


@pytest.fixture(scope="module")
def gpt_oss_hf(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(folder, model, logits of TOKENS) of tests/test_gpt_oss_hf.py's sharpened GptOssForCausalLM
    (the debug flavor: 32 tokens see past twice its 16-key window)."""
    from tests.support.gpt_oss import sharpened_hf
    from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS

    folder = tmp_path_factory.mktemp("gpt_oss_hf")
    model = sharpened_hf(dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=64))
    model.save_pretrained(folder, max_shard_size="300KB")
    with torch.no_grad():
        return folder, model, model(TOKENS).logits


def _family_jobs(root: Path, deepseek_v3_folder: Path, gpt_oss_folder: Path) -> list[dict]:
    """The logits jobs of DeepSeek-V3's and gpt-oss's imports on FAMILY_LAYOUTS."""
    from tests import test_deepseek_v3

    jobs = []
    for layout, extra in FAMILY_LAYOUTS.items():
        load = ("--mixed_precision.enabled", "false", "--checkpoint.enable", "--checkpoint.initial_load_path")
        dsv3 = test_deepseek_v3._job(root / f"deepseek_v3_{layout}", *load, str(deepseek_v3_folder), *extra)
        jobs.append(
            {"args": dsv3, "logits": str(root / f"deepseek_v3_{layout}.pt"), "tokens": test_deepseek_v3.TOKENS.tolist()}
        )
        gpt_oss = _job(root / f"gpt_oss_{layout}", gpt_oss_folder, *extra)
        gpt_oss[gpt_oss.index("moe")], gpt_oss[gpt_oss.index(FLAVOR)] = "gpt_oss", "debugmodel"
        jobs.append({"args": gpt_oss, "logits": str(root / f"gpt_oss_{layout}.pt"), "tokens": TOKENS.tolist()})
    # gpt-oss's forward on FlexAttention under TP 2 (the sinks split with the heads).
    gpt_oss = _job(root / "gpt_oss_tp_flex", gpt_oss_folder, *FAMILY_LAYOUTS["tp"])
    gpt_oss[gpt_oss.index("moe")], gpt_oss[gpt_oss.index(FLAVOR)] = "gpt_oss", "debugmodel"
    logits = str(root / "gpt_oss_tp_flex.pt")
    jobs.append({"args": gpt_oss, "logits": logits, "tokens": TOKENS.tolist(), "attention_backend": "flex"})
    return jobs


@pytest.fixture(scope="module")
def dist_run(hf, qwen3_hf, deepseek_v3_hf, gpt_oss_hf, tmp_path_factory) -> Path:
    """One 2-rank launch: import on each layout (logits of TOKENS), then import on FSDP 2 and
    train STEPS steps with a checkpoint and its Hugging Face export (last_save_hf) at the end."""
    root = tmp_path_factory.mktemp("dist")
    jobs = [
        {"args": _job(root / layout, hf[0], *extra), "logits": str(root / f"{layout}.pt"), "tokens": TOKENS.tolist()}
        for layout, extra in LAYOUTS.items()
    ]
    jobs += [
        {
            "args": _qwen3_job(root / f"qwen3_{layout}", qwen3_hf[0], *LAYOUTS[layout]),
            "logits": str(root / f"qwen3_{layout}.pt"),
            "tokens": TOKENS.tolist(),
        }
        for layout in QWEN3_LAYOUTS
    ]
    jobs += _family_jobs(root, deepseek_v3_hf[0], gpt_oss_hf[0])
    jobs.append(
        {
            "args": _job(
                root / "train",
                hf[0],
                *LAYOUTS["fsdp"],
                "--training.steps",
                str(STEPS),
                "--checkpoint.interval",
                str(STEPS),
                "--checkpoint.last_save_hf",
            )
        }
    )
    spec = write_spec(root, jobs)
    result = spawn_ranks(2, [sys.executable, __file__, str(spec)], timeout=300, env=ONE_THREAD)
    assert result.returncode == 0, result.describe()
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_import_matches_transformers_on_two_ranks(hf, dist_run, layout):
    got = torch.load(dist_run / f"{layout}.pt", weights_only=True)
    assert got.shape == hf[2].shape
    print(f"{layout}: max abs error {(got - hf[2]).abs().max().item():.3g}")
    assert (got - hf[2]).abs().max() <= LOGITS_ATOL


@pytest.mark.parametrize("layout", QWEN3_LAYOUTS)
def test_qwen3_import_matches_transformers_on_two_ranks(qwen3_hf, dist_run, layout):
    """The dense Qwen3 family's import on FSDP 2 / TP 2: transformers' logits (tests/test_qwen3.py's
    bound)."""
    from tests import test_qwen3

    got = torch.load(dist_run / f"qwen3_{layout}.pt", weights_only=True)
    assert got.shape == qwen3_hf[2].shape
    print(f"qwen3 {layout}: max abs error {(got - qwen3_hf[2]).abs().max().item():.3g}")
    assert (got - qwen3_hf[2]).abs().max() <= test_qwen3.LOGITS_ATOL


@pytest.mark.parametrize("layout", list(FAMILY_LAYOUTS))
def test_deepseek_v3_import_matches_transformers_on_two_ranks(deepseek_v3_hf, dist_run, layout):
    """DeepSeek-V3's import (MLA, group-limited routing, a shared expert) on FSDP 2 / TP 2 / EP 2:
    transformers' logits (tests/test_deepseek_v3.py's bound)."""
    from tests import test_deepseek_v3

    got, want = torch.load(dist_run / f"deepseek_v3_{layout}.pt", weights_only=True), deepseek_v3_hf[2]
    assert got.shape == want.shape
    print(f"deepseek_v3 {layout}: max abs error {(got - want).abs().max().item():.3g}")
    assert (got - want).abs().max() <= test_deepseek_v3.LOGITS_ATOL


@pytest.mark.parametrize("layout", list(FAMILY_LAYOUTS))
def test_gpt_oss_import_matches_transformers_on_two_ranks(gpt_oss_hf, dist_run, layout):
    """gpt-oss's import (sinks split with the heads under TP, expert biases with the experts under
    EP) on FSDP 2 / TP 2 / EP 2: transformers' logits within tests/test_gpt_oss.py's bound
    (relative to the logits' scale)."""
    from tests import test_gpt_oss

    got, want = torch.load(dist_run / f"gpt_oss_{layout}.pt", weights_only=True), gpt_oss_hf[2]
    assert got.shape == want.shape
    scale = want.abs().max().item()
    print(f"gpt_oss {layout}: max abs error {(got - want).abs().max().item():.3g} on a scale of {scale:.3g}")
    assert (got - want).abs().max().item() <= test_gpt_oss.TOL * scale


def _checkpoint_model(step_dir: Path) -> dict[str, torch.Tensor]:
    sd = MoETransformer(ARGS).state_dict()
    with quiet_single_process():
        dcp.load({"model": sd}, checkpoint_id=str(step_dir), no_dist=True)
    return sd


@pytest.fixture(scope="module")
def exported(dist_run, tmp_path_factory) -> Path:
    """The trained run's last checkpoint exported by the CLI, in fp32, in shards of <= 30 kB."""
    out = tmp_path_factory.mktemp("export") / "hf"
    result = run_python(
        "-m",
        "torchtitan_amp.checkpoint",
        "export",
        "--format",
        "hf",
        str(dist_run / "train" / "checkpoint" / f"step-{STEPS}"),
        str(out),
        "--dtype",
        "float32",
        "--max-shard-size",
        "30kB",
    )
    assert result.returncode == 0, result.describe()
    return out


def test_export_loads_in_transformers_with_our_logits(hf, dist_run, exported):
    from transformers import Qwen3MoeForCausalLM

    model, info = Qwen3MoeForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    trained = MoETransformer(ARGS)
    trained.load_state_dict(_checkpoint_model(dist_run / "train" / "checkpoint" / f"step-{STEPS}"))
    ours = _logits(trained.eval())
    with torch.no_grad():
        error = (model.eval()(TOKENS).logits - ours).abs().max().item()
    print(f"export: max |logit| {ours.abs().max().item():.3f}, max abs error {error:.3g}")
    assert error <= LOGITS_ATOL
    # Training moved the weights, so this is not the imported model compared to its source.
    assert (ours - hf[2]).abs().max() > 100 * LOGITS_ATOL
    # The published names, exactly those transformers saves.
    assert set(json.loads((exported / INDEX).read_text())["weight_map"]) == set(
        json.loads((hf[0] / INDEX).read_text())["weight_map"]
    )


def test_export_reimport_is_bitwise(dist_run, exported):
    saved = _checkpoint_model(dist_run / "train" / "checkpoint" / f"step-{STEPS}")
    for folder in (exported, dist_run / "train" / "checkpoint" / f"hf-step-{STEPS}"):  # the CLI's, last_save_hf's
        again = _ours(folder).state_dict()
        assert saved.keys() == again.keys()
        assert all(torch.equal(saved[k], again[k]) for k in saved)


def test_config_round_trips(tmp_path):
    from transformers import Qwen3MoeConfig

    (tmp_path / CONFIG).write_text(json.dumps(hf_config(ARGS, "bfloat16", 256, 257, family=FAMILY)))
    check_config(tmp_path, ARGS, FLAVOR, FAMILY)
    theirs = Qwen3MoeConfig.from_pretrained(tmp_path)
    assert (
        theirs.num_experts,
        theirs.num_experts_per_tok,
        theirs.norm_topk_prob,
        theirs.mlp_only_layers,
        theirs.head_dim,
        theirs.moe_intermediate_size,
        theirs.intermediate_size,
    ) == (8, 2, True, [0], 32, 32, 96)
    assert theirs.rope_parameters["rope_theta"] == 1_000_000.0 and theirs.sliding_window is None


def test_published_qwen3_30b_a3b_config_fits_its_flavor(tmp_path):
    """config.json of Qwen/Qwen3-30B-A3B as published (transformers 4.51 spelling)."""
    (tmp_path / CONFIG).write_text(
        json.dumps(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "attention_bias": False,
                "attention_dropout": 0.0,
                "bos_token_id": 151643,
                "decoder_sparse_step": 1,
                "eos_token_id": 151645,
                "head_dim": 128,
                "hidden_act": "silu",
                "hidden_size": 2048,
                "initializer_range": 0.02,
                "intermediate_size": 6144,
                "max_position_embeddings": 40960,
                "max_window_layers": 48,
                "mlp_only_layers": [],
                "model_type": "qwen3_moe",
                "moe_intermediate_size": 768,
                "norm_topk_prob": True,
                "num_attention_heads": 32,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "num_hidden_layers": 48,
                "num_key_value_heads": 4,
                "output_router_logits": False,
                "rms_norm_eps": 1e-06,
                "rope_scaling": None,
                "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.001,
                "sliding_window": None,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "use_cache": True,
                "use_sliding_window": False,
                "vocab_size": 151936,
            }
        )
    )
    check_config(tmp_path, FAMILY.build_args("qwen3_30b_a3b", 151936, 4096), "qwen3_30b_a3b", FAMILY)
    with pytest.raises(CheckpointError, match=r"'num_hidden_layers' = 48 but model.flavor 'qwen3_x' has n_layers = 27"):
        check_config(tmp_path, FAMILY.build_args("moe_16b_gqa", 151936, 4096), "qwen3_x", FAMILY)
    # A flavor of the right shapes with a shared expert is named by that field.
    shared = dataclasses.replace(FAMILY.build_args("qwen3_30b_a3b", 151936, 4096), n_shared_experts=1)
    with pytest.raises(
        CheckpointError,
        match=r"'shared experts \(none in Qwen3-MoE\)' = 0 but model.flavor "
        r"'qwen3_x' has n_shared_experts = 1",
    ):
        check_config(tmp_path, shared, "qwen3_x", FAMILY)


def _edit_config(folder: Path, **changes) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"mlp_only_layers": [1]}, r"'mlp_only_layers' = \[1\]; only the first layers can be dense"),
        ({"mlp_only_layers": [], "decoder_sparse_step": 2}, r"'decoder_sparse_step' = 2; only 1"),
        (
            {"use_sliding_window": True, "sliding_window": 16},
            r"'use_sliding_window' = True; this model supports only False",
        ),
        ({"model_type": "qwen2_moe"}, r"'model_type' = 'qwen2_moe'; only 'qwen3_moe'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, r"rope scaling type 'yarn'"),
        ({"num_experts": 16}, r"'num_experts' = 16 but model.flavor 'x' has n_routed_experts = 8"),
        ({"norm_topk_prob": False}, r"'norm_topk_prob' = False but model.flavor 'x' has route_norm = True"),
        ({"mlp_only_layers": []}, r"'mlp_only_layers' = \[\] but model.flavor 'x' has n_dense_layers = 1"),
        ({"hidden_act": "gelu"}, r"'hidden_act' = 'gelu'; this model supports only 'silu'"),
    ],
)
def test_unrepresentable_config_is_one_line(tmp_path, changes, message):
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(ARGS, "float32", None, None, family=FAMILY)))
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message) as e:
        check_config(tmp_path, ARGS, "x", FAMILY)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_shared_experts": 1}, r"n_shared_experts = 1, but Qwen3-MoE has no shared expert"),
        ({"score_func": "sigmoid"}, r"score_func = 'sigmoid', but Qwen3-MoE routes on softmax scores"),
        ({"route_scale": 2.5}, r"route_scale = 2.5, but Qwen3-MoE does not scale"),
        ({"qk_norm": False}, r"qk_norm = False, but Qwen3-MoE always normalises"),
    ],
)
def test_unexportable_args_are_one_line(changes, message):
    with pytest.raises(CheckpointError, match=message) as e:
        hf_config(dataclasses.replace(ARGS, **changes), "float32", None, None, family=FAMILY)
    assert "\n" not in str(e.value)


def test_nonzero_expert_bias_is_not_exported():
    """Bias balancing moves the choice of experts; Qwen3-MoE has no bias, so its routing would differ."""
    key = "layers.1.feed_forward.router.expert_bias"
    assert to_hf_tensors(FAMILY.hf, key, torch.zeros(8), ARGS, Path("ckpt")) == {}
    with pytest.raises(CheckpointError, match=rf"ckpt: '{key}' is nonzero, and a Qwen3-MoE model has no place"):
        to_hf_tensors(FAMILY.hf, key, torch.full((8,), 1e-3), ARGS, Path("ckpt"))


def _copy(folder: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in folder.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _drop_expert(folder: Path, name: str = "model.layers.2.mlp.experts.7.up_proj.weight") -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / INDEX).read_text())
    shard = folder / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (folder / INDEX).write_text(json.dumps(index))


def _add_expert(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    shard = sorted(folder.glob("*.safetensors"))[-1]
    tensors = load_file(str(shard))
    save_file({**tensors, "model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}, str(shard))


def _shrink_expert(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    shard = folder / json.loads((folder / INDEX).read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    save_file({**tensors, name: tensors[name][:-1]}, str(shard))


@pytest.mark.parametrize(
    "break_it, message",
    [
        (
            _drop_expert,
            r"has no tensor 'model.layers.2.mlp.experts.7.up_proj.weight' \(a part of "
            r"'layers.2.feed_forward.experts.w3'\)",
        ),
        (
            _add_expert,
            r"tensor 'model.layers.1.mlp.experts.8.up_proj.weight' has no place in this model "
            r"\('layers.1.feed_forward.experts.w3' stacks 8 tensors\)",
        ),
        (_shrink_expert, r"the parts of 'layers.1.feed_forward.experts.w1' differ in shape or dtype"),
    ],
)
def test_broken_experts_are_one_line(hf, tmp_path, break_it, message):
    folder = _copy(hf[0], tmp_path / "hf")
    break_it(folder)
    with pytest.raises(CheckpointError, match=message) as e:
        _ours(folder)
    assert "\n" not in str(e.value)


def test_gpt_oss_flex_under_tp_equals_one_process_sdpa(gpt_oss_hf, dist_run):
    """gpt-oss's forward on FlexAttention under TP 2 (each rank's sinks are its heads' shard; the
    windows' BlockMasks; no grad: CPU) gives the one-process SDPA forward's logits and the TP 2
    SDPA forward's. Flex sums each attention output in another order, as TP does its row-parallel
    sums: tests/test_gpt_oss.py's fp32 bound for this model (TOL of the logits' scale, derived from
    the blocks' chains of fp32 sums in other orders) covers both. Measured (2-core CPU): 1.5e-5 vs
    TP SDPA, 8.3e-6 vs one process, on a scale below 1; every rank taking rank 0's sinks: 0.72."""
    from tests.test_gpt_oss import TOL
    from tests.test_gpt_oss_hf import _imported
    from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS

    with torch.no_grad():
        want = _imported(gpt_oss_hf[0], dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=64))(TOKENS)
    got = torch.load(dist_run / "gpt_oss_tp_flex.pt", weights_only=True)
    sdpa_tp = torch.load(dist_run / "gpt_oss_tp.pt", weights_only=True)
    assert got.shape == want.shape
    scale = want.abs().max().item()
    diffs = [(got - want).abs().max().item(), (got - sdpa_tp).abs().max().item()]
    print(f"gpt_oss tp 2 flex: max |logit diff| {diffs[0]:.3g} vs one process, {diffs[1]:.3g} vs tp sdpa ({scale:.3g})")
    assert max(diffs) <= TOL * scale


if __name__ == "__main__":  # the worker: ckpt_jobs.py with FLAVOR registered in this process
    import runpy

    MOE_FLAVORS[FLAVOR] = ARGS
    from tests import test_qwen3
    from torchtitan_amp.models.qwen3.model import QWEN3_FLAVORS

    QWEN3_FLAVORS[test_qwen3.FLAVOR] = test_qwen3.ARGS
    from tests import test_deepseek_v3
    from torchtitan_amp.models.deepseek_v3.model import DEEPSEEK_V3_FLAVORS

    DEEPSEEK_V3_FLAVORS[test_deepseek_v3.FLAVOR] = test_deepseek_v3.ARGS
    runpy.run_path(str(WORKERS / "ckpt_jobs.py"), run_name="__main__")
