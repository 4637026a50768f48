"""The Qwen3 dense family (models/qwen3/), checked against transformers' own Qwen3ForCausalLM: tiny
random ones (GQA 4 heads over 2, head_dim 32 = twice hidden / heads, norm weights moved off 1 so
that the q/k-norm permutation matters, weights drawn at std 0.05 so that attention is far from
uniform), saved by save_pretrained in small safetensors shards, untied and tied. Import gives
transformers' logits; a run trained from the import in process exports a folder that transformers
loads with our logits; greedy generation is transformers' generate token for token; the published
sizes' config.json files fit their flavors; under the bf16 plan the q/k norms compute in fp32 (the
audit's hooks) and a q/k norm run in bf16 is a breach; bad input is one line. All in process, on
tiny shapes. The layouts (FSDP, TP, PP, CP, FSDP x TP) against one process: tests/test_parallelisms.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.hf import HFExport, save_hf_export
from tests.support.launch import by_step
from torchtitan_amp.checkpoint.hf import CONFIG, INDEX, check_config, hf_config, load_hf
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models import get_family
from torchtitan_amp.models.llama3.model import Attention, RMSNorm
from torchtitan_amp.models.qwen3 import FAMILY
from torchtitan_amp.models.qwen3.model import QWEN3_FLAVORS, Qwen3ModelArgs, Qwen3Transformer

pytestmark = pytest.mark.unit

FLAVOR = "qwen3_hf_test"
ARGS = Qwen3ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    explicit_head_dim=32,
    intermediate_dim=96,
    vocab_size=258,
    max_seq_len=32,
)
TIED = dataclasses.replace(ARGS, enable_weight_tying=True)
TOKENS = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(7))
# fp32, max |ours - transformers| over all logits. The two compute the same sums in other orders
# (interleaved vs half rotary, SDPA vs transformers' kernel, fused vs unfused RMSNorm): each of the
# ~10 roundings per block is ~6e-8 relative, grown by sqrt(K) (K <= 128) in the dot products, over
# 2 blocks and the 64-wide head; on logits of max ~2 (printed: errors ~1e-6 measured) that is a few 1e-6. 1e-5 holds it
# with margin and is still 1e-5 of the differences a wrong layout gives (asserted > 100x this).
LOGITS_ATOL = 1e-5
STEPS = 3


def _hf_config(tied: bool):  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        initializer_range=0.05,
    )


EXPORTS = {
    tied: HFExport("Qwen3ForCausalLM", lambda t=tied: _hf_config(t), TOKENS, max_shard_size="20KB", perturb_norms=True)
    for tied in (False, True)
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):  # type: ignore[no-untyped-def]
    """tied -> (folder, transformers model, its logits of TOKENS), for an untied and a tied model."""
    return {tied: save_hf_export(spec, tmp_path_factory.mktemp("hf")) for tied, spec in EXPORTS.items()}


def _ours(folder: Path, args: Qwen3ModelArgs) -> Qwen3Transformer:
    model = Qwen3Transformer(args)
    model.init_weights()
    load_hf(model, folder, args, complete_model=True, family=FAMILY)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_matches_transformers(exports, tied: bool) -> None:  # type: ignore[no-untyped-def]
    (folder, theirs, reference), args = exports[tied], TIED if tied else ARGS
    names = set(json.loads((folder / INDEX).read_text())["weight_map"])
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert ("lm_head.weight" in names) is not args.enable_weight_tying
    ours = _ours(folder, args)
    got = _logits(ours)
    error = (got - reference).abs().max().item()
    print(f"max |logit| {reference.abs().max().item():.3f}, max abs error {error:.3g}")
    assert error <= LOGITS_ATOL
    if args.enable_weight_tying:
        assert ours.output.weight is ours.tok_embeddings.weight
    # What the forward must get right shows: Llama's attention (no q/k norm) on the same weights,
    # or the q norms left in Hugging Face's element order, are far off.
    sd = ours.state_dict()
    llama = _ours(folder, args)
    for layer in llama.layers.values():
        layer.attention.normalize_qk = Attention.normalize_qk.__get__(layer.attention)  # Llama's: none
    no_norms = (_logits(llama) - reference).abs().max().item()
    assert no_norms > 100 * LOGITS_ATOL
    for layer in range(args.n_layers):
        sd[f"layers.{layer}.attention.q_norm.weight"] = theirs.model.layers[layer].self_attn.q_norm.weight.detach()
    ours.load_state_dict(sd)
    unpermuted = (_logits(ours) - reference).abs().max().item()
    print(f"without q/k norms {no_norms:.3g}, q norms in HF's order {unpermuted:.3g}")
    assert unpermuted > 100 * LOGITS_ATOL


def test_greedy_generation_equals_transformers_generate(exports) -> None:  # type: ignore[no-untyped-def]
    """Our KV-cached greedy generation on the imported model, token for token transformers' generate."""
    from torchtitan_amp.eval.generation import ModelRunner, generate

    folder, theirs, _ = exports[False]
    prompt, new = [256, *b"Hello"], 16
    ours = generate(ModelRunner(_ours(folder, ARGS)), prompt, new).tokens
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None)
    assert ours == out[0, len(prompt) :].tolist()
    assert len(set(ours)) > 1  # not one token repeated


def _job(dump: Path, *extra: str) -> list[str]:
    return [
        "--model.name",
        "qwen3",
        "--model.flavor",
        FLAVOR,
        "--model.tokenizer",
        "byte",
        "--training.seq_len",
        "32",
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


@pytest.fixture
def flavor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(QWEN3_FLAVORS, FLAVOR, ARGS)
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)  # MFU is not read here


def _trainer(*argv: str):  # type: ignore[no-untyped-def]
    from torchtitan_amp.train.trainer import Trainer

    return Trainer(load_config(list(argv)))


def test_import_train_export_loads_in_transformers(exports, tmp_path, flavor) -> None:  # type: ignore[no-untyped-def]
    """checkpoint.initial_load_path = the untied folder through the trainer (config.json checked
    against the flavor), STEPS fp32 steps, the last checkpoint's Hugging Face export
    (last_save_hf): transformers loads it with no missing or unexpected keys and gives the trained
    model's logits; reimported, it is the trained state bit for bit."""
    from transformers import Qwen3ForCausalLM

    folder, _, reference = exports[False]
    trainer = _trainer(
        *_job(tmp_path, "--mixed_precision.enabled", "false", "--checkpoint.enable"),
        *("--checkpoint.initial_load_path", str(folder), "--training.steps", str(STEPS)),
        *("--checkpoint.interval", str(STEPS), "--checkpoint.last_save_hf"),
    )
    assert (_logits(trainer.run.model.eval()) - reference).abs().max() <= LOGITS_ATOL
    trainer.run.model.train()
    trainer.train()
    trained = trainer.run.model.eval()
    ours = _logits(trained)
    assert (ours - reference).abs().max() > 100 * LOGITS_ATOL  # training moved the weights
    exported = tmp_path / "checkpoint" / f"hf-step-{STEPS}"
    model, info = Qwen3ForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        error = (model.eval()(TOKENS).logits - ours).abs().max().item()
    print(f"export: max abs error {error:.3g}")
    assert error <= LOGITS_ATOL
    # The published names, exactly those transformers saves.
    written = {k for f in exported.glob("*.safetensors") for k in load_file(str(f))}
    assert written == set(json.loads((folder / INDEX).read_text())["weight_map"])
    again = _ours(exported, ARGS).state_dict()
    saved = trained.state_dict()
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)


def test_debugmodel_trains_and_its_loss_falls(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The family's debug flavor through the trainer on the bundled data (what `python train.py
    --model.name qwen3 --model.flavor debugmodel` runs), fp32: the loss of the last of 8 steps is
    below the first's."""
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
    argv = _job(tmp_path, "--mixed_precision.enabled", "false", "--training.steps", "8")
    argv[argv.index(FLAVOR)] = "debugmodel"
    trainer = _trainer(*argv)
    assert isinstance(trainer.run.model, Qwen3Transformer)
    trainer.train()
    losses = {step: row["loss"] for step, row in by_step(tmp_path).items() if "loss" in row}
    print(f"losses {losses}")
    assert losses[8] < losses[1] - 0.5


def test_bf16_plan_keeps_qk_norms_fp32_and_the_audit_checks_them(tmp_path, flavor) -> None:  # type: ignore[no-untyped-def]
    """Under the bf16 plan (autocast on one process) the audit's hooks see every q/k norm compute in
    fp32 while the projections around them run in bf16, the report counts them in the norms' fp32
    group, and a
    q norm that computes in bf16 is named as a breach."""
    bf16 = ("--mixed_precision.enabled", "true", "--training.steps", "1")
    result = _trainer(*_job(tmp_path / "ok", *bf16)).audit()
    assert result.ok, result.breaches
    for layer in range(ARGS.n_layers):
        for norm in ("q_norm", "k_norm"):
            assert result.modules[f"layers.{layer}.attention.{norm}"]["compute"] == ["float32"]
        assert result.modules[f"layers.{layer}.attention.wq"]["forward matmul"] == ["bfloat16"]
    report = json.loads((tmp_path / "ok" / "precision_report.json").read_text())
    norms = [g for g in report["param_groups"] if g["module_type"].endswith(".RMSNorm")]
    # One fp32 group of every norm: per block two of dim and the q and k norms of head_dim, the final.
    per_block = 2 * ARGS.dim + 2 * ARGS.head_dim
    assert [(g["compute_dtype"], g["num_params"]) for g in norms] == [("float32", ARGS.n_layers * per_block + ARGS.dim)]

    class Bf16Norm(RMSNorm):  # claims fp32, computes in its input's dtype
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    trainer = _trainer(*_job(tmp_path / "breach", *bf16))
    attention = trainer.run.model.layers["0"].attention
    bad = Bf16Norm(ARGS.head_dim, ARGS.norm_eps)
    bad.weight = attention.q_norm.weight
    attention.q_norm = bad
    breaches = trainer.audit().breaches
    assert [b.what for b in breaches] == ["layers.0.attention.q_norm: computes_in_fp32 module"]


def test_published_configs_fit_their_flavors(tmp_path) -> None:
    """config.json of each published Qwen3 dense size (transformers 4.51 spelling) against its flavor;
    their parameter counts are the published ones (0.6B: 596,049,920 with the tied table once)."""
    published = {
        "qwen3_0_6b": (1024, 3072, 28, 16, True, 596_049_920),
        "qwen3_1_7b": (2048, 6144, 28, 16, True, 1_720_574_976),
        "qwen3_4b": (2560, 9728, 36, 32, True, 4_022_468_096),
        "qwen3_8b": (4096, 12288, 36, 32, False, 8_190_735_360),
        "qwen3_14b": (5120, 17408, 40, 40, False, 14_768_307_200),
        "qwen3_32b": (5120, 25600, 64, 64, False, 32_762_123_264),
    }
    for name, (hidden, inter, layers, heads, tied, params) in published.items():
        cfg = {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "max_position_embeddings": 40960,
            "max_window_layers": layers,
            "model_type": "qwen3",
            "num_attention_heads": heads,
            "num_hidden_layers": layers,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": tied,
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
            "vocab_size": 151936,
        }
        (tmp_path / CONFIG).write_text(json.dumps(cfg))
        args = FAMILY.build_args(name, 151936, 4096)
        check_config(tmp_path, args, name, FAMILY)
        with torch.device("meta"):
            assert sum(p.numel() for p in FAMILY.build_model(args).parameters()) == params, name
        assert FAMILY.memory_dims(args).total_params() == params
    with pytest.raises(
        CheckpointError, match=r"'num_hidden_layers' = 64 but model.flavor 'qwen3_14b' has n_layers = 40"
    ):
        check_config(tmp_path, FAMILY.build_args("qwen3_14b", 151936, 4096), "qwen3_14b", FAMILY)


def test_config_round_trips_through_transformers(tmp_path) -> None:
    from transformers import Qwen3Config

    for args in (ARGS, TIED):
        (tmp_path / CONFIG).write_text(json.dumps(hf_config(args, "bfloat16", 256, 257, family=FAMILY)))
        check_config(tmp_path, args, FLAVOR, FAMILY)
        theirs = Qwen3Config.from_pretrained(tmp_path)
        assert (theirs.head_dim, theirs.intermediate_size, theirs.num_key_value_heads) == (32, 96, 2)
        assert theirs.tie_word_embeddings is args.enable_weight_tying and theirs.sliding_window is None
        assert theirs.rope_parameters["rope_theta"] == 1_000_000.0


def _edit_config(folder: Path, **changes) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "qwen3_moe"}, r"'model_type' = 'qwen3_moe'; only 'qwen3' can be loaded"),
        ({"model_type": "llama"}, r"'model_type' = 'llama'; only 'qwen3' can be loaded"),
        ({"attention_bias": True}, r"'attention_bias' = True; this model supports only False"),
        ({"use_sliding_window": True, "sliding_window": 16}, r"'use_sliding_window' = True; this model supports"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope scaling type 'yarn' is not supported"),
        ({"head_dim": 16}, r"'head_dim' = 16 but model.flavor 'x' has head_dim = 32"),
        ({"intermediate_size": 128}, r"'intermediate_size' = 128 but model.flavor 'x' has ffn_hidden = 96"),
        ({"tie_word_embeddings": False}, r"'tie_word_embeddings' = False but model.flavor 'x' has enable_weight"),
    ],
)
def test_unrepresentable_config_is_one_line(tmp_path, changes, message) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(TIED, "float32", None, None, family=FAMILY)))
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message) as e:
        check_config(tmp_path, TIED, "x", FAMILY)
    assert "\n" not in str(e.value)


def test_other_families_folders_and_flavors_are_one_line(tmp_path) -> None:
    """A Qwen3 folder under the Llama or MoE family, a Llama folder under Qwen3, and a flavor of one
    family under another: each one error line."""
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(ARGS, "float32", None, None, family=FAMILY)))
    llama = get_family("llama3")
    with pytest.raises(CheckpointError, match=r"'model_type' = 'qwen3'; only 'llama' can be loaded"):
        check_config(tmp_path, llama.build_args("debugmodel_tiny", 258, 32), "debugmodel_tiny", llama)
    moe = get_family("moe")
    with pytest.raises(CheckpointError, match=r"'model_type' = 'qwen3'; only 'qwen3_moe' can be loaded"):
        check_config(tmp_path, moe.build_args("debugmodel_qwen3", 258, 32), "debugmodel_qwen3", moe)
    (tmp_path / CONFIG).write_text(
        json.dumps(hf_config(llama.build_args("debugmodel_tiny", 258, 32), "float32", None, None, family=llama))
    )
    with pytest.raises(CheckpointError, match=r"'model_type' = 'llama'; only 'qwen3' can be loaded"):
        check_config(tmp_path, ARGS, "x", FAMILY)
    for argv, message in (
        (
            ["--model.name", "qwen3", "--model.flavor", "llama3_8b"],
            "'llama3_8b' is not a flavor of model.name = 'qwen3'",
        ),
        (["--model.flavor", "qwen3_8b"], "'qwen3_8b' is not a flavor of model.name = 'llama3'"),
        (["--model.name", "moe", "--model.flavor", "qwen3_0_6b"], "'qwen3_0_6b' is not a flavor of model.name = 'moe'"),
    ):
        with pytest.raises(ConfigError, match=message) as e:
            load_config(argv)
        assert "\n" not in str(e.value)


def test_bad_shapes_are_refused_at_config_time() -> None:
    with pytest.raises(ValueError, match=r"head dim 33 must be positive and even"):
        dataclasses.replace(ARGS, explicit_head_dim=33)
    with pytest.raises(ValueError, match=r"n_heads 4 not divisible by n_kv_heads 3"):
        dataclasses.replace(ARGS, n_kv_heads=3)
    with pytest.raises(CheckpointError, match=r"use_scaled_rope = True, but Qwen3 has no llama3 rope scaling"):
        hf_config(dataclasses.replace(ARGS, use_scaled_rope=True), "float32", None, None, family=FAMILY)


def test_family_is_llamas_with_qwen3s_parts() -> None:
    """What the family shares with Llama's and what it replaces; the TP plan splits the q/k norms by
    head (each rank normalises its own heads with the one weight)."""
    from torchtitan_amp.models.moe.parallelize import HeadShardedNorm

    llama = get_family("llama3")
    replaced = {"name", "model_cls", "args_cls", "flavors", "tp_block_plan", "memory_dims", "hf"}
    for field in dataclasses.fields(FAMILY):
        if field.name not in replaced:
            assert getattr(FAMILY, field.name) is getattr(llama, field.name), field.name
    block = Qwen3Transformer(ARGS).layers["0"]
    plan = FAMILY.tp_block_plan(None, block)
    assert isinstance(plan["attention.q_norm"], HeadShardedNorm) and isinstance(
        plan["attention.k_norm"], HeadShardedNorm
    )
    assert block.feed_forward.w1.weight.shape == (96, 64) and block.attention.wq.weight.shape == (128, 64)


@pytest.mark.parametrize("name", ["debugmodel", "qwen3_0_6b", "qwen3_8b"])
def test_memory_model_names_and_sizes_every_parameter(name: str) -> None:
    """The memory model's parameter specs (MoEDims with every block dense) are the model's
    parameters, names and shapes, the tied table once."""
    from torchtitan_amp.memory import Stage

    args = FAMILY.flavors[name]
    with torch.device("meta"):
        model = FAMILY.build_model(args)
    specs = FAMILY.memory_dims(args).param_specs(Stage(0, range(args.n_layers), True, True))
    assert {s.name: s.shape for s in specs} == {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16"])
def test_activation_formula_matches_saved_tensors(precision: str) -> None:
    """A block's saved-for-backward bytes (3 blocks minus 1, per token) equal the memory model's
    terms for this CPU, q/k norms included (their term alone: the same blocks without the norms
    save exactly that much less). 120 tokens: the measure skips tensors shaped like a parameter,
    so the token count must be none of the parameters' dims (128 = n_heads x head_dim would hide
    the [tokens, dim] inputs of wq, wk and wv)."""
    import functools

    from tests.test_memory_moe import _saved_bytes
    from torchtitan_amp import memory
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.memory.llama import activation_terms
    from torchtitan_amp.precision import PrecisionPlan, autocast, memory_spec

    enabled = "false" if precision == "fp32" else "true"
    config = load_config(["--model.name", "qwen3", "--mixed_precision.enabled", enabled])
    plan = PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu")
    b, s = 3, 40
    per_block = {}
    for qk_norm in (True, False):
        measured = []
        for layers in (1, 3):
            torch.manual_seed(0)
            model = FAMILY.build_model(dataclasses.replace(ARGS, n_layers=layers, max_seq_len=s))
            model.init_weights()
            if not qk_norm:
                for block in model.layers.values():
                    block.attention.normalize_qk = Attention.normalize_qk.__get__(block.attention)
            autocast.apply_fp32_islands(plan, model)
            context = functools.partial(autocast.forward_context, plan)
            measured.append(_saved_bytes(model, torch.randint(0, 258, (b, s)), context))
        per_block[qk_norm] = (measured[1] - measured[0]) / 2
    layout = memory.Layout(seq_len=s, local_batch_size=b)
    dims, prec = FAMILY.memory_dims(ARGS), memory_spec.from_plan(plan, FAMILY.norm_cls)
    terms, llama = dims.activation_terms(prec, layout), activation_terms(dims, prec, layout)
    tokens = layout.microbatch_tokens
    assert per_block[True] == (terms.layer_at(0) + terms.layer_cpu) * tokens
    assert per_block[True] - per_block[False] == (terms.layer_at(0) - llama.layer) * tokens


def test_block_compiles_in_one_graph() -> None:
    """A Qwen3 block under torch.compile with the family's fullgraph setting (what apply_compile
    uses: one graph, the q/k norms inside it) computes eager's output and gradients, fp32.
    aot_eager: dynamo, fake tensors and AOT autograd as inductor sees them, without the C++ compile."""
    assert FAMILY.compile_fullgraph
    torch.manual_seed(0)
    model = Qwen3Transformer(ARGS)
    model.init_weights()
    block = model.layers["0"]
    x = torch.randn(2, 16, ARGS.dim, requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, block):
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = fn(x, model.rope_cos, model.rope_sin)
        y.square().sum().backward()
        results.append([y.detach(), x.grad.clone(), *(p.grad.clone() for p in block.parameters())])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
