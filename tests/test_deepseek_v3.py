"""The DeepSeek-V3 family (models/deepseek_v3/) against transformers' DeepseekV3ForCausalLM, in
process: a tiny random one (MLA with both low-rank projections, YaRN x4 with an mscale_all_dim that
changes the softmax scale, a dense first block, then 8 experts in 4 groups, top 3 of the best 2
groups, a shared expert, routed_scaling_factor 2.5), sharpened so that what it computes matters:
random norm weights, router weights x8 and a random e_score_correction_bias, so that the bias and
the group limit change which experts tokens go to. Import gives transformers' logits; our export
loads in transformers with no missing or unexpected keys and gives ours; what the family cannot
take is refused in one line.

Tolerance (fp32): every op rounds at 2**-24 relative; the logits (max |logit| ~5, printed) come out of
3 blocks whose longest reductions are 128 terms, and the two sides sum in different orders (SDPA's
kernel vs transformers', the experts' per-token combine vs index_add), so the difference is a few
hundred ulps of the logits' scale at most: LOGITS_ATOL = 1e-5 (the measured one is printed).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torchtitan_amp.checkpoint.hf import CONFIG, check_config, hf_config, load_hf, to_hf_tensors
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models import FAMILIES
from torchtitan_amp.models.deepseek_v3 import FAMILY
from torchtitan_amp.models.deepseek_v3.mla import softmax_scale
from torchtitan_amp.models.deepseek_v3.model import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, DeepSeekV3Transformer

LOGITS_ATOL = 1e-5
TOKENS = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(3))
YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0}
ARGS = DeepSeekV3Args(
    dim=64,
    n_layers=3,
    n_heads=4,
    vocab_size=258,
    max_seq_len=64,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    top_k=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_inter_dim=32,
    n_dense_layers=1,
    dense_inter_dim=128,
    route_scale=2.5,
    rope_factor=4.0,
    rope_original_seq_len=16,
    mscale=1.0,
    mscale_all_dim=0.8,
)


def _hf_config():  # type: ignore[no-untyped-def]
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **YARN, "mscale_all_dim": 0.8},
        num_mtp_layers=0,
        initializer_range=0.05,
    )


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return save_hf(tmp_path_factory.mktemp("hf"))


def save_hf(folder: Path):  # type: ignore[no-untyped-def]
    """(folder, transformers model, its logits of TOKENS), saved in 20 KB shards (a layer's experts
    span files) after sharpening: norm weights moved off 1, router weights x8, a random
    correction bias. tests/test_hf_moe.py's launch imports it on layouts too."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.5 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.mul_(8.0)
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    model.save_pretrained(folder, max_shard_size="20KB")
    with torch.no_grad():
        return folder, model, model(TOKENS).logits


def _ours(folder: Path, args: DeepSeekV3Args = ARGS) -> DeepSeekV3Transformer:
    model = DeepSeekV3Transformer(args)
    model.init_weights()
    load_hf(model, folder, args, complete_model=True, family=FAMILY)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def test_forward_matches_transformers(hf):
    folder, _, reference = hf
    ours = _ours(folder)
    got = _logits(ours)
    error = (got - reference).abs().max().item()
    print(f"max |logit| {reference.abs().max().item():.3f}, max abs error {error:.3g}")
    assert error <= LOGITS_ATOL
    assert ours.layers["1"].feed_forward.router.expert_bias.abs().min() > 0  # read, not zeroed
    # What the forward must get right shows: without the group limit, without the correction
    # bias, or without YaRN's softmax-scale correction, the logits are far off.
    for change in ({"n_group": 1, "topk_group": 1}, {"mscale_all_dim": 0.0}):
        other = DeepSeekV3Transformer(dataclasses.replace(ARGS, **change))
        other.load_state_dict(ours.state_dict())
        assert (_logits(other.eval()) - reference).abs().max() > 100 * LOGITS_ATOL, change
    sd = ours.state_dict()
    for layer in ("1", "2"):
        sd[f"layers.{layer}.feed_forward.router.expert_bias"].zero_()
    ours.load_state_dict(sd)
    assert (_logits(ours) - reference).abs().max() > 100 * LOGITS_ATOL


def test_config_round_trips(hf):
    folder = hf[0]
    check_config(folder, ARGS, "test", FAMILY)
    written = hf_config(ARGS, "float32", None, None, FAMILY)
    assert FAMILY.hf.config_fields(written, folder) == FAMILY.hf.config_fields(
        json.loads((folder / CONFIG).read_text()), folder
    )
    with pytest.raises(CheckpointError, match=r"'n_group' = 4 but model.flavor 'x' has n_group = 1"):
        check_config(folder, dataclasses.replace(ARGS, n_group=1, topk_group=1), "x", FAMILY)


def test_export_loads_in_transformers(hf, tmp_path):
    """Our model's tensors as the export writes them (to_hf_tensors, hf_config), loaded by
    transformers with no missing or unexpected keys: the same logits as ours."""
    import transformers
    from safetensors.torch import save_file

    ours = _ours(hf[0])
    with torch.no_grad():  # move off the imported weights, so the check is of the export
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out: dict[str, torch.Tensor] = {}
    for key, value in ours.state_dict().items():
        out.update({k: v.contiguous() for k, v in to_hf_tensors(FAMILY.hf, key, value, ARGS, tmp_path).items()})
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(ARGS, "float32", None, None, FAMILY)))
    theirs, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        error = (theirs.eval()(TOKENS).logits - _logits(ours)).abs().max().item()
    assert error <= LOGITS_ATOL


def test_softmax_scale_is_transformers():
    from transformers.modeling_rope_utils import yarn_apply_mscale

    params = {"rope_type": "yarn", "rope_theta": 1e4, **YARN, "mscale_all_dim": 0.8}
    assert softmax_scale(ARGS) == pytest.approx(yarn_apply_mscale(params, 24**-0.5), rel=1e-12)


def test_flavors_build_on_meta():
    """Every flavor builds; the published 671B's parameter count is DeepSeek-V3's 671B without its
    multi-token prediction depth (the model card: 671B total without the 14B MTP module, which also
    counts its copies of the embedding and head; ours shares them: 11.6B)."""
    from torchtitan_amp.models.spec import count_params

    assert FAMILIES["deepseek_v3"] is FAMILY
    counts, mtp = {}, {}
    for name, flavor in DEEPSEEK_V3_FLAVORS.items():
        with torch.device("meta"):
            model = DeepSeekV3Transformer(flavor)
        counts[name] = count_params(model)
        mtp[name] = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    assert DEEPSEEK_V3_FLAVORS["deepseek_v3_671b"].mtp_depth == 1  # the published num_nextn_predict_layers
    assert 671e9 < counts["deepseek_v3_671b"] - mtp["deepseek_v3_671b"] < 672e9, counts
    assert 11.6e9 < mtp["deepseek_v3_671b"] < 11.7e9, mtp
    assert counts["deepseek_v3_671b_no_mtp"] == counts["deepseek_v3_671b"] - mtp["deepseek_v3_671b"]
    assert 15e9 < counts["deepseek_v3_16b"] < 16.5e9, counts


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
        ({"topk_group": 5}, r"topk_group 5 not in \[1, n_group = 4\]"),
        ({"top_k": 7}, "top_k 7 exceeds the experts of topk_group 2 groups"),
        ({"n_kv_heads": 2}, "MLA has one key/value per head"),
        ({"qk_rope_head_dim": 7}, "must be even for rope"),
        ({"mtp_depth": -1}, "mtp_depth -1 must be >= 0"),
        ({"mtp_depth": 64}, r"mtp_depth 64 must be below the sequence length 64 \(training.seq_len\)"),
    ],
)
def test_bad_args_say_why(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ARGS, **change)


def _job(dump: Path, *extra: str) -> list[str]:
    return [
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        FLAVOR,
        "--model.tokenizer",
        "byte",
        "--training.seq_len",
        "48",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


FLAVOR = "deepseek_v3_hf_test"
MTP_ONE = dataclasses.replace(ARGS, mtp_depth=1)  # its module is mtp.3, HF's model.layers.3


def _trainer(monkeypatch: pytest.MonkeyPatch, argv: list[str], args: DeepSeekV3Args = ARGS):  # type: ignore[no-untyped-def]
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import trainer as trainer_module

    monkeypatch.setitem(DEEPSEEK_V3_FLAVORS, FLAVOR, args)
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)  # MFU is not read here
    return trainer_module.Trainer(load_config(argv))


def test_import_through_the_trainer_then_train(hf, tmp_path, monkeypatch):
    """model.name / model.flavor pick the family; checkpoint.initial_load_path = the folder (its
    config.json checked against the flavor) gives transformers' logits; 6 fp32 steps on the bundled
    data lower the loss."""
    argv = ["--mixed_precision.enabled", "false", "--training.steps", "6", "--checkpoint.enable"]
    trainer = _trainer(monkeypatch, _job(tmp_path, *argv, "--checkpoint.initial_load_path", str(hf[0])))
    try:
        assert (_logits(trainer.run.model.eval()) - hf[2]).abs().max() <= LOGITS_ATOL
        trainer.run.model.train()
        trainer.train()
    finally:
        trainer.run.metrics.close()
    losses = [
        json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]
    # Batches differ (bundled text): the mean of the last three against the first.
    assert len(losses) == 6 and sum(losses[3:]) / 3 < losses[0] - 0.4, losses


def test_bf16_plan_keeps_latent_norms_router_and_rotary_in_fp32(tmp_path, monkeypatch):
    """One audited bf16 step (mixed_precision.audit, the dtypes its dispatch hooks see), with one MTP
    depth: MLA's latent norms, the block norms and the MTP module's enorm / hnorm / norm compute in
    fp32, the router's matmul in fp32, every projection and
    the experts in bf16; with the kv latent norm made to compute in bf16, the audit names it."""
    import torch.nn.functional as F

    argv = ["--mixed_precision.enabled", "true", "--mixed_precision.audit", "true", "--training.steps", "1"]
    result = _trainer(monkeypatch, _job(tmp_path / "ok", *argv), MTP_ONE).audit()
    assert result.ok, result.breaches
    modules = result.modules
    for name in ("enorm", "hnorm", "norm", "block.attention.kv_norm"):  # the MTP module's norms
        assert modules[f"mtp.3.{name}"] == {"compute": ["float32"]}, (name, modules)
    assert modules["mtp.3.eh_proj"]["forward matmul"] == ["bfloat16"], modules
    for name in ("attention.q_norm", "attention.kv_norm", "attention_norm", "ffn_norm"):
        assert modules[f"layers.1.{name}"] == {"compute": ["float32"]}, (name, modules)
    assert modules["layers.1.feed_forward.router"]["forward matmul"] == ["float32"], modules
    for name in ("attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b", "attention.wo"):
        assert modules[f"layers.1.{name}"]["forward matmul"] == ["bfloat16"], (name, modules)
    assert modules["layers.1.feed_forward.experts"]["forward matmul"] == ["bfloat16"], modules

    def bf16_norm(self, x):  # type: ignore[no-untyped-def]
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    trainer = _trainer(monkeypatch, _job(tmp_path / "breach", *argv))
    norm = trainer.run.model.layers["1"].attention.kv_norm
    monkeypatch.setattr(norm, "forward", bf16_norm.__get__(norm))
    result = trainer.audit()
    assert not result.ok and any("layers.1.attention.kv_norm" in str(b) for b in result.breaches), result.breaches


def test_a_flavor_of_another_family_is_one_line():
    from torchtitan_amp.config import load_config
    from torchtitan_amp.core.errors import ConfigError

    for name, flavor, allowed in (
        ("deepseek_v3", "debugmodel_moe", "'debugmodel', 'deepseek_v3_16b', 'deepseek_v3_671b'"),
        ("moe", "deepseek_v3_671b", ""),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(["--model.name", name, "--model.flavor", flavor])
        assert f"'model.flavor' = '{flavor}' is not a flavor of model.name = '{name}'" in str(e.value)
        assert allowed in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen3_moe"}, "'model_type' = 'qwen3_moe'; only 'deepseek_v3' can be loaded"),
        ({"model_type": "deepseek_v2"}, "'model_type' = 'deepseek_v2'; only 'deepseek_v3' can be loaded"),
        ({"rope_interleave": False}, "'rope_interleave' = False; this model supports only True"),
        ({"scoring_func": "softmax"}, "'scoring_func' = 'softmax'; this model supports only 'sigmoid'"),
        ({"attention_bias": True}, "'attention_bias' = True; this model supports only False"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope scaling type 'linear' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, **YARN, "truncate": False}},
            "rope_scaling 'truncate' = False is not supported",
        ),
    ],
)
def test_hf_folders_it_cannot_take_are_one_line(hf, tmp_path, change, message):
    cfg = {**json.loads((hf[0] / CONFIG).read_text()), **change}
    (tmp_path / CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        check_config(tmp_path, ARGS, "test", FAMILY)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_deepseek_folder_under_the_moe_family_is_one_line(hf):
    from torchtitan_amp.models.moe import FAMILY as MOE
    from torchtitan_amp.models.moe.model import MOE_FLAVORS

    with pytest.raises(CheckpointError, match="'model_type' = 'deepseek_v3'; only 'qwen3_moe' can be loaded"):
        check_config(hf[0], MOE_FLAVORS["debugmodel_moe"], "debugmodel_moe", MOE)


def test_greedy_generation_equals_transformers_and_the_cache_equals_recompute(hf):
    """Our generation (a KV cache of MLA's expanded keys and narrower values on every layer) on
    the imported model gives transformers' greedy tokens, token for token; each cached decode
    step's logits equal one forward over the whole text."""
    from torchtitan_amp.eval.generation import ModelRunner, generate, kv_caches, step_logits

    prompt, new = [256, *b"Hello"], 24
    ours = _ours(hf[0])
    completion = generate(ModelRunner(ours), prompt, new)
    with torch.no_grad():
        theirs = hf[1].generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=257, pad_token_id=257
        )
    assert completion.tokens == theirs[0, len(prompt) :].tolist()
    tokens = prompt + completion.tokens
    runner = ModelRunner(ours)
    with torch.no_grad(), kv_caches(ours, len(tokens)) as caches:
        steps = [step_logits(runner, torch.tensor([prompt]), caches)]
        steps += [step_logits(runner, torch.tensor([[t]]), caches) for t in tokens[len(prompt) : -1]]
    with torch.no_grad():
        full = ours(torch.tensor([tokens]))[0, len(prompt) - 1 : -1]
    assert (torch.cat(steps) - full).abs().max() <= LOGITS_ATOL


@pytest.mark.parametrize("flavor", list(DEEPSEEK_V3_FLAVORS))
def test_memory_terms_hold_the_models_parameters(flavor):
    """The memory model's parameter specs are the model's, name for name and shape for shape."""
    from torchtitan_amp.memory import MLADims, Stage

    args = DEEPSEEK_V3_FLAVORS[flavor]
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    specs = {s.name: s.shape for s in MLADims.from_args(args).param_specs(Stage(0, range(args.n_layers), True, True))}
    assert specs == {k: tuple(v.shape) for k, v in model.named_parameters()}


def test_dry_run_of_671b_on_256_ranks(tmp_path):
    """The 671B flavor dry-runs on 256 fake ranks with EP 32 (FSDP 256, which its multi-token
    prediction depth takes): the model's parameter count (682.6B with the depth's 11.6B; 38.2B
    active), and the analytic state (memory model) equal to the fake run's shards."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import dry_run

    argv = ["--model.name", "deepseek_v3", "--model.flavor", "deepseek_v3_671b", "--job.dump_folder", str(tmp_path)]
    argv += ["--dry_run.vocab_size", "129280", "--training.seq_len", "4096", "--training.local_batch_size", "1"]
    report = dry_run.run(load_config([*argv, "--parallelism.expert_parallel_degree", "32"]), world_size=256, rank=0)
    model = report["model"]
    assert model["total_params"] == 682_636_472_320 and 38.2e9 < model["active_params"] < 38.3e9, model
    assert report["memory"]["analytic_state_matches"]


# --- Multi-token prediction ------------------------------------------------------------------
#
# Tolerance of the loss against the hand-written formula (fp32): both sides run the same block
# module (TRM_k, checked against transformers' decoder layer above); what differs is the rest in
# another order of the same ops (RMSNorm as x * rsqrt(mean x^2 + eps) * w instead of F.rms_norm,
# log_softmax + gather instead of F.cross_entropy). Those differ by a few fp32 roundings (2**-24
# relative) of values of size ~1..10, carried through one block and the 64-term output sums into
# per-token losses of ~10 (the head sharpened x20); the mean over ~90 targets then differs by well under 1e-5 relative:
# MTP_RTOL = 1e-5 (the measured one is printed). An off-by-one shift changes the loss by ~1e-2 or
# more (asserted > 100 x the bound).

MTP_RTOL = 1e-5
MTP_ARGS = dataclasses.replace(ARGS, mtp_depth=2, mtp_loss_weight=0.3)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_mtp_loss(model: DeepSeekV3Transformer, tokens, labels, emb_shift: int = 0, label_shift: int = 0):
    """The report's L_MTP = (lambda / D) sum_k (1 / T) sum_i CE(P^k_{i+k+1}, t_{i+k+1}) from plain ops
    on the model's weights (h^0: the last layer's output, before the final norm); `emb_shift` /
    `label_shift` move the tokens read / predicted (an off-by-one implementation)."""
    a, emb, head = model.model_args, model.tok_embeddings.weight, model.output.weight
    seen: list[torch.Tensor] = []
    last = model.layers[str(a.n_layers - 1)].register_forward_hook(lambda m, i, o: seen.append(o))
    model(tokens)
    last.remove()
    h, seq, n = seen[0], tokens.shape[1], (labels != -100).sum()
    total = torch.zeros(())
    for k in range(1, a.mtp_depth + 1):
        m = model.mtp[str(a.n_layers + k - 1)]
        s, j = seq - k - max(emb_shift, label_shift), k
        e = emb[tokens[:, j + emb_shift : j + emb_shift + s]]
        x = torch.cat([_rms(e, m.enorm.weight, a.norm_eps), _rms(h[:, :s], m.hnorm.weight, a.norm_eps)], -1)
        h = m.block(x @ m.eh_proj.weight.T, model.rope_cos, model.rope_sin)
        logp = torch.log_softmax(_rms(h, m.norm.weight, a.norm_eps) @ head.T, dim=-1)
        target = labels[:, j + label_shift : j + label_shift + s]
        valid = target != -100
        total = total - logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[valid].sum() / n
    return a.mtp_loss_weight / a.mtp_depth * total


def test_mtp_loss_is_the_reports_formula():
    """Our MTP loss (depth 2, a routed block each, some labels ignored, the output head sharpened x20
    so that the target token matters) divided by the main loss's label count equals the hand-written
    formula; reading or predicting one token off does not."""
    torch.manual_seed(1)
    model = DeepSeekV3Transformer(MTP_ARGS)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.5 * torch.randn_like(p))
        model.output.weight.mul_(20.0)  # logits spread out: which token is the target matters
    labels = torch.roll(TOKENS, -1, dims=1)
    labels[0, 5] = labels[1, 30] = -100
    with torch.no_grad():
        model(TOKENS, labels=labels)
        ours = model.pop_mtp_loss() / (labels != -100).sum()
        reference = _reference_mtp_loss(model, TOKENS, labels)
        error = abs(ours.item() - reference.item()) / reference.item()
        print(f"MTP loss {ours.item():.6f}, relative error {error:.3g}")
        assert error <= MTP_RTOL
        assert model.pop_mtp_loss() is None  # handed over once
        for shift in ({"emb_shift": 1}, {"label_shift": 1}):
            off = _reference_mtp_loss(model, TOKENS, labels, **shift)
            assert abs(ours.item() - off.item()) / reference.item() > 100 * MTP_RTOL, shift


def _mtp_folder(hf, tmp_path: Path) -> tuple[Path, DeepSeekV3Transformer]:
    """transformers' weights plus one random MTP module, exported as the export writes (to_hf_tensors,
    hf_config): a folder with num_nextn_predict_layers 1 and model.layers.3.*."""
    from safetensors.torch import save_file

    args = dataclasses.replace(ARGS, mtp_depth=1)
    torch.manual_seed(2)
    model = DeepSeekV3Transformer(args)
    model.init_weights()
    missing = model.load_state_dict(_ours(hf[0]).state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith("mtp.3.") for k in missing), missing
    with torch.no_grad():
        for p in model.mtp.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        out.update({k: v.contiguous() for k, v in to_hf_tensors(FAMILY.hf, key, value, args, tmp_path).items()})
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(args, "float32", None, None, FAMILY)))
    return tmp_path, model.eval()


def test_mtp_in_hf_layout_round_trips_and_leaves_the_logits_alone(hf, tmp_path):
    """The MTP module goes out as HF's layer num_hidden_layers (its own names, the block's usual ones,
    the embedding and head again) and comes back bit for bit; the logits with it are those without
    it, bit for bit, and transformers' on the main weights; a flavor without MTP refuses the folder."""
    from safetensors import safe_open

    folder, exported = _mtp_folder(hf, tmp_path)
    args = exported.model_args
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = {n.removeprefix("model.layers.3.") for n in f.keys() if n.startswith("model.layers.3.")}
        assert torch.equal(f.get_tensor("model.layers.3.shared_head.head.weight"), exported.output.weight)
        assert torch.equal(f.get_tensor("model.layers.3.embed_tokens.weight"), exported.tok_embeddings.weight)
    expected = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight"}
    expected |= {"embed_tokens.weight", "self_attn.q_a_proj.weight", "mlp.experts.7.down_proj.weight"}
    expected |= {"mlp.gate.e_score_correction_bias", "mlp.shared_experts.up_proj.weight", "input_layernorm.weight"}
    assert expected <= names, expected - names
    assert json.loads((folder / CONFIG).read_text())["num_nextn_predict_layers"] == 1
    check_config(folder, args, "test", FAMILY)
    back = _ours(folder, args)
    assert back.state_dict().keys() == exported.state_dict().keys()
    for key, value in exported.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    without = _logits(_ours(hf[0]))
    with torch.no_grad():
        with_labels = back(TOKENS, labels=torch.roll(TOKENS, -1, dims=1))
    assert back.pop_mtp_loss() is not None
    assert torch.equal(_logits(back), without) and torch.equal(with_labels, without)
    assert (without - hf[2]).abs().max() <= LOGITS_ATOL
    with pytest.raises(CheckpointError) as e:
        check_config(folder, ARGS, "test", FAMILY)
    assert "'num_nextn_predict_layers' = 1 but model.flavor 'test' has mtp_depth = 0" in str(e.value)


def test_training_with_mtp_lowers_both_losses(tmp_path, monkeypatch):
    """6 fp32 steps through the trainer with mtp_depth 1 from random weights: the main loss and the
    logged mtp_loss fall (its layouts: tests/test_deepseek_v3_mtp.py, tests/test_moe_dist.py)."""
    monkeypatch.setitem(DEEPSEEK_V3_FLAVORS, FLAVOR, dataclasses.replace(ARGS, mtp_depth=1))
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import trainer as trainer_module

    argv = ["--mixed_precision.enabled", "false", "--training.steps", "6", "--checkpoint.enable", "false"]
    trainer = trainer_module.Trainer(load_config(_job(tmp_path, *argv)))
    try:
        trainer.train()
    finally:
        trainer.run.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    for key in ("loss", "mtp_loss"):
        values = [r[key] for r in rows]
        assert len(values) == 6 and sum(values[3:]) / 3 < values[0] - 0.2, (key, values)


def saved_bytes_per_block(family, args, precision: str, layers=(1, 3), s: int = 40, b: int = 3):  # type: ignore[no-untyped-def]
    """Saved-for-backward bytes per token of the blocks each model of `layers` blocks adds to the
    one before it, per block (default: (3 blocks - 1 block) / 2), and the memory model's terms for
    the same shape and precision plan on this CPU. 120 tokens: none of the parameters' dims (the
    measure skips tensors shaped like a parameter)."""
    import functools

    from tests.test_memory_moe import _saved_bytes
    from torchtitan_amp import memory
    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.precision import PrecisionPlan, autocast, memory_spec

    enabled = "false" if precision == "fp32" else "true"
    config = load_config(["--model.name", family.name, "--mixed_precision.enabled", enabled])
    plan = PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu")
    measured = []
    for n in layers:
        torch.manual_seed(0)
        model = family.build_model(dataclasses.replace(args, n_layers=n, max_seq_len=s))
        model.init_weights()
        autocast.apply_fp32_islands(plan, model)
        context = functools.partial(autocast.forward_context, plan)
        measured.append(_saved_bytes(model, torch.randint(0, 258, (b, s)), context))
    layout = memory.Layout(seq_len=s, local_batch_size=b)
    terms = family.memory_dims(args).activation_terms(memory_spec.from_plan(plan, family.norm_cls), layout)
    steps = [
        (m1 - m0) / (n1 - n0) / layout.microbatch_tokens
        for m0, m1, n0, n1 in zip(measured, measured[1:], layers, layers[1:])
    ]
    return steps, terms


@pytest.mark.parametrize("q_lora_rank", [32, 0])
@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16"])
def test_mla_activation_formula_matches_saved_tensors(precision, q_lora_rank):
    """A dense MLA block's saved-for-backward bytes per token equal the memory model's terms for
    this CPU (MLA's latents and norms, its narrower values, CPU's math-path attention), exactly:
    with and without the query latent, fp32 and bf16 autocast (the latent inputs cast twice)."""
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], n_dense_layers=4, q_lora_rank=q_lora_rank)
    (per_block,), terms = saved_bytes_per_block(FAMILY, args, precision)
    assert per_block == terms.layer_at(0) + terms.layer_cpu
