"""Tied embeddings (model args' enable_weight_tying, Hugging Face's tie_word_embeddings): the
output projection's weight IS the embedding table, one Parameter on every path.

In process: the tie survives what re-creates parameters (storage dtype, freezing, to_empty), the
table is initialised once, its gradient is the sum of both uses, the precision plan gives both
modules one precision, and what cannot hold a tied weight (pipeline parallel, one-sided freezing,
fp8 of the output) is refused in one line. Shrunk copies of the four published configs
(tests/test_llama_flavors.py: tying, rope scaling 32 or none, GQA ratio kept, tiny dims) round
trip through transformers: built as LlamaForCausalLM, saved as safetensors, imported through
checkpoint.initial_load_path, trained a step, exported at the end (checkpoint.last_save_hf) and
loaded by transformers again. One 2-rank launch: FSDP 2, DDP 2 and TP 2 against one process (fp32),
and an FSDP resume from a checkpoint that holds the table once.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.support.launch import launch_worker, read_metrics
from tests.test_llama_flavors import PUBLISHED
from torchtitan_amp import memory
from torchtitan_amp.checkpoint.hf import CONFIG, INDEX
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.models import count_params
from torchtitan_amp.models.llama3 import model as llama
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, Transformer, ffn_hidden_dim
from torchtitan_amp.precision import by_name, freeze
from torchtitan_amp.precision.lowbit import float8
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train.data_parallel import group_by_block

pytestmark = pytest.mark.dist

TIED = "debugmodel_tiny_tied"
TIED_ARGS = dataclasses.replace(LLAMA3_FLAVORS["debugmodel_tiny"], enable_weight_tying=True)
FP32 = ("--mixed_precision.enabled", "false")
LOGITS_ATOL = 1e-5  # fp32, two implementations of one model: test_hf measured 1.5e-7
TOKENS = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(7))


@pytest.fixture
def tied_flavor(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(llama.LLAMA3_FLAVORS, TIED, TIED_ARGS)
    return TIED


def _tied(model: nn.Module) -> bool:
    return model.output.weight is model.tok_embeddings.weight


def _job(*args: str, world_size: int = 1) -> job_mod.Job:
    return job_mod.resolve(load_config(["--model.flavor", TIED, *args]), world_size, "cpu")


# ---------------------------------------------------------------------------------------------
# One parameter


def test_one_parameter_counted_saved_and_initialised_once(tied_flavor: str) -> None:
    job = _job(*FP32)
    model = job_mod.build_model_parts(job, torch.device("cpu"), [0]).parts[0]  # meta -> to_empty -> init
    untied = Transformer(dataclasses.replace(TIED_ARGS, enable_weight_tying=False))
    table = TIED_ARGS.vocab_size * TIED_ARGS.dim
    assert _tied(model) and count_params(model) == count_params(untied) - table
    assert [n for n, _ in model.named_parameters() if "output" in n] == []
    assert "output.weight" not in model.state_dict() and len(model.state_dict()) == len(untied.state_dict()) - 1
    # Initialised once, as the output projection: truncated normal of std dim**-0.5 (the
    # embedding's std-1 normal run after it would leave std 1). Truncation at 3 sigma shrinks the
    # std by 1.3%; 16512 samples measure it to ~0.6%.
    expected = TIED_ARGS.dim**-0.5 * 0.9866
    assert abs(float(model.tok_embeddings.weight.detach().std()) / expected - 1) < 0.05
    # load_state_dict fills output.weight from the table, into the same tensor.
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    assert _tied(model) and torch.equal(model.output.weight, sd["tok_embeddings.weight"])


def test_tie_survives_storage_dtype_freezing_and_to_empty(tied_flavor: str) -> None:
    job = _job("--training.dtype", "bfloat16", "--training.freeze", "tok_embeddings,output")
    with torch.device("meta"):
        model = Transformer(job.model_args)
    freeze.apply_storage_dtype(job.plan, model)
    by_name.mark_fp32_by_name(job.plan, model)
    freeze.freeze(job.plan, model)
    assert _tied(model) and model.output.weight.dtype == torch.bfloat16 and not model.output.weight.requires_grad
    model.to_empty(device="cpu")  # a new tensor per module: init_weights ties them again
    assert not _tied(model)
    model.init_weights()
    assert _tied(model)


def test_gradient_is_the_sum_of_both_uses(tied_flavor: str) -> None:
    """The tied table's gradient equals the embedding's plus the output's of an untied copy with
    the same values (fp32; only the order of one addition differs)."""
    torch.manual_seed(0)
    tied = Transformer(TIED_ARGS)
    tied.init_weights()
    untied = Transformer(dataclasses.replace(TIED_ARGS, enable_weight_tying=False))
    untied.load_state_dict({**tied.state_dict(), "output.weight": tied.state_dict()["tok_embeddings.weight"]})
    for model in (tied, untied):
        model(TOKENS).float().logsumexp(-1).sum().backward()
    both = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    assert untied.tok_embeddings.weight.grad.abs().max() > 0 and untied.output.weight.grad.abs().max() > 0
    assert torch.allclose(tied.tok_embeddings.weight.grad, both, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# One precision


def _meta_model(job: job_mod.Job) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(job.model_args)
    by_name.mark_fp32_by_name(job.plan, model)
    return model


def test_the_table_takes_the_output_projections_precision(tied_flavor: str) -> None:
    """bf16 FSDP with the default safe list (nn.Linear): the embedding follows the output into
    the bf16 root group instead of an fp32 group of its own (FSDP holds a parameter in one group);
    named in fp32_module_names (either name), both stay fp32 and form one FSDP unit even where
    torch 2.11 makes a unit per module. The memory model counts the table once, as a Linear."""
    mp = ("--mixed_precision.enabled", "true", "--mixed_precision.param_dtype", "bfloat16")
    fsdp = ("--parallelism.data_parallel_shard_degree", "2")
    job = _job(*mp, *fsdp, world_size=2)
    model = _meta_model(job)
    assert job.plan.path == "fsdp" and job.plan.is_safe(model.tok_embeddings) and job.plan.is_safe(model.output)
    assert model.tok_embeddings not in job.plan.fp32_modules(model)
    groups = memory.fsdp_groups(
        job.model_dims, job.precision, job.layout, memory.rank_stages(job.model_dims, job.layout, 0)[0]
    )
    root = next(g for g in groups if g.kind == "root")
    assert root.gather_dtype == "bfloat16" and not any("tok_embeddings" in g.name for g in groups if g.kind == "fp32")
    assert job.model_dims.total_params() == count_params(model)
    for name in ("output", "tok_embeddings"):
        job = _job(*mp, *fsdp, "--mixed_precision.fp32_module_names", name, world_size=2)
        model = _meta_model(job)
        assert not job.plan.is_safe(model.tok_embeddings) and not job.plan.is_safe(model.output)
        fp32 = job.plan.fp32_modules(model)
        assert [model.tok_embeddings, model.output] in group_by_block(model, fp32, grouped=False)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (
            ("--parallelism.pipeline_parallel_degree", "2"),
            ConfigError,
            r"'parallelism.pipeline_parallel_degree' = 2 cannot split model.flavor 'debugmodel_tiny_tied', "
            r"whose output",
        ),
        (
            ("--training.freeze", "tok_embeddings"),
            PrecisionError,
            r"'training.freeze' freezes 'tok_embeddings' but not 'output', which shares its weight",
        ),
    ],
)
def test_what_cannot_hold_a_tied_weight_is_one_line(tied_flavor: str, args: tuple, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as e:
        _job(*FP32, *args, world_size=2)
    assert "\n" not in str(e.value)


def test_fp8_must_skip_a_tied_output(tied_flavor: str) -> None:
    """fp8 of the output projection is refused (its default skip list keeps 'output' out)."""
    plan = dataclasses.replace(_job(*FP32).plan, fp8="tensorwise", fp8_skip=())
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(TIED_ARGS, dim=64, vocab_size=256))  # fp8 needs multiples of 16
    with pytest.raises(
        PrecisionError,
        match=r"'mixed_precision.fp8_skip_modules' must cover 'output': its weight "
        r"is shared with 'tok_embeddings'",
    ) as e:
        float8.check_fp8_modules(model, plan.fp8, plan.fp8_skip)
    assert "\n" not in str(e.value)
    float8.check_fp8_modules(model, plan.fp8, ("output",))


# ---------------------------------------------------------------------------------------------
# Shrunk published configs through transformers


def _shrunk(flavor: str) -> tuple[llama.LlamaModelArgs, dict]:
    """The flavor and its published config.json at tiny dims with their structure kept: tying,
    rope scaling (factor 32 from position 16 on, so that it changes a 32-token window) or none,
    the GQA ratio (one kv head), head dim 16, 2 layers, the byte tokenizer's 258 tokens."""
    published = PUBLISHED[flavor]
    ratio = published["num_attention_heads"] // published["num_key_value_heads"]
    args = dataclasses.replace(
        LLAMA3_FLAVORS[flavor],
        dim=16 * ratio,
        n_layers=2,
        n_heads=ratio,
        n_kv_heads=1,
        ffn_dim_multiplier=None,
        multiple_of=16,
        vocab_size=258,
        max_seq_len=32,
        rope_original_max_position=16,
    )
    cfg = {
        **published,
        "hidden_size": args.dim,
        "num_hidden_layers": 2,
        "num_attention_heads": ratio,
        "num_key_value_heads": 1,
        "intermediate_size": ffn_hidden_dim(args.dim, 16, None),
        "vocab_size": 258,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "float32",
    }
    if "head_dim" in published:
        cfg["head_dim"] = 16
    if published["rope_scaling"]:
        cfg["rope_scaling"] = {**published["rope_scaling"], "original_max_position_embeddings": 16}
    return args, cfg


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_shrunk_published_config_round_trips_with_transformers(
    flavor: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from torchtitan_amp.train import trainer as trainer_module

    args, cfg = _shrunk(flavor)
    monkeypatch.setitem(llama.LLAMA3_FLAVORS, "shrunk", args)
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)  # MFU is not read here
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**copy.deepcopy(cfg))).eval()  # it edits rope_scaling in place
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with torch.no_grad():
        reference = theirs(TOKENS).logits
    trainer = trainer_module.Trainer(
        load_config(
            [
                "--model.flavor",
                "shrunk",
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "2",
                *FP32,
                "--training.steps",
                "1",
                "--optimizer.lr",
                "1e-2",
                "--lr_scheduler.warmup_steps",
                "1",
                "--checkpoint.enable",
                "--checkpoint.initial_load_path",
                str(tmp_path / "hf"),
                "--checkpoint.last_save_hf",
                "--job.dump_folder",
                str(tmp_path / "run"),
            ]
        )
    )
    try:
        model = trainer.run.model
        assert _tied(model) == cfg["tie_word_embeddings"]
        with torch.no_grad():
            imported = float((model.eval()(TOKENS) - reference).abs().max())
        assert imported <= LOGITS_ATOL
        model.train()
        trainer.train()
        with torch.no_grad():
            trained = model.eval()(TOKENS)
        assert _tied(model) == cfg["tie_word_embeddings"]
    finally:
        trainer.run.metrics.close()
    exported = tmp_path / "run" / "checkpoint" / "hf-step-1"
    out_cfg = json.loads((exported / CONFIG).read_text())
    assert out_cfg["tie_word_embeddings"] == cfg["tie_word_embeddings"]
    assert out_cfg["rope_scaling"] == cfg["rope_scaling"]
    names = set()
    for shard in exported.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names |= set(f.keys())
    assert ("lm_head.weight" in names) != cfg["tie_word_embeddings"] and not (exported / INDEX).exists()
    again, info = LlamaForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert (again.lm_head.weight is again.model.embed_tokens.weight) == cfg["tie_word_embeddings"]
    with torch.no_grad():
        got = again.eval()(TOKENS).logits
    moved, exported_diff = float((got - reference).abs().max()), float((got - trained).abs().max())
    print(f"{flavor}: import {imported:.1e}, export {exported_diff:.1e} (training moved logits {moved:.1e})")
    # Training moved the weights, and transformers computes what our model computes.
    assert moved > 100 * LOGITS_ATOL and exported_diff <= LOGITS_ATOL


# ---------------------------------------------------------------------------------------------
# FSDP 2, DDP 2 and TP 2 against one process; FSDP resume

STEPS = 3
BASE = [
    "--model.flavor",
    TIED,
    "--training.seq_len",
    "32",
    "--optimizer.lr",
    "2e-2",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--training.seed",
    "0",
    *FP32,
]
LAYOUTS = {
    "fsdp": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
    "ddp": [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--training.local_batch_size",
        "2",
    ],
    "tp": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
}
# fp32, one process vs two: the same sums in other orders. test_parallelisms measured <= 1.7e-7
# relative on the loss of this model; the gradient's reductions add ~1e-7 relative per element.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5  # of the gradient's largest element


def _single_process(root: Path) -> Path:
    """The reference run, in this process (one rank): losses of STEPS steps and step 1's grads."""
    from tests.workers import layouts
    from torchtitan_amp.train import trainer as trainer_module

    folder = root / "single"
    trainer = trainer_module.Trainer(
        load_config(
            [
                *BASE,
                "--training.steps",
                str(STEPS),
                "--training.local_batch_size",
                "4",
                "--job.dump_folder",
                str(folder),
            ]
        )
    )
    try:
        layouts._save_grads_after_first_step(trainer)
        trainer.train()
    finally:
        trainer.run.metrics.close()
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tied")
    ckpt = [*BASE, *LAYOUTS["fsdp"], "--checkpoint.enable", "--checkpoint.interval", "2"]
    jobs = [
        {"name": name, "args": [*BASE, *extra, "--training.steps", str(STEPS)], "grads": True}
        for name, extra in LAYOUTS.items()
    ]
    # The same folder twice: 2 steps with a checkpoint at step 2, then a resume that runs step 3.
    jobs += [
        {"name": "resumed", "args": [*ckpt, "--training.steps", "2"]},
        {"name": "resumed", "args": [*ckpt, "--training.steps", str(STEPS)]},
    ]
    flavors = {TIED: {"base": "debugmodel_tiny", "enable_weight_tying": True}}
    launch_worker("layouts", root, jobs, 2, flavors=flavors)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(llama.LLAMA3_FLAVORS, TIED, TIED_ARGS)
        mp.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
        _single_process(root)
    return root


def _losses(folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(folder) if "loss" in r]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp_ddp_and_tp_train_as_one_process(runs: Path, layout: str) -> None:
    single, got = _losses(runs / "single"), _losses(runs / layout)
    assert len(single) == len(got) == STEPS and single[0] != single[-1]
    rel = max(abs(a - b) / abs(a) for a, b in zip(single, got))
    want = torch.load(runs / "single" / "grads_rank0.pt", weights_only=True)
    grads = [torch.load(runs / layout / f"grads_rank{r}.pt", weights_only=True) for r in range(2)]
    g = want["tok_embeddings.weight"]
    worst = max(float((rank["tok_embeddings.weight"] - g).abs().max()) for rank in grads)
    print(
        f"{layout}: loss max rel diff {rel:.2e}, tied gradient max abs diff {worst:.2e} "
        f"(largest element {float(g.abs().max()):.2e})"
    )
    assert rel <= LOSS_RTOL
    # The table's gradient holds both uses (one key: no output.weight parameter) on every rank.
    assert all("output.weight" not in rank for rank in [want, *grads])
    assert worst <= GRAD_RTOL * float(g.abs().max())
    info = [json.loads((runs / layout / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(i["output_tied"] == [True] for i in info)


def test_fsdp_resume_is_bitwise_from_a_checkpoint_holding_the_table_once(runs: Path) -> None:
    saved = dcp.FileSystemReader(str(runs / "resumed" / "checkpoint" / "step-2")).read_metadata()
    keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert "model.tok_embeddings.weight" in keys and "model.output.weight" not in keys
    assert not any(k.startswith("optimizer.") and "output.weight" in k for k in saved.state_dict_metadata)
    resumed = {r["step"]: r["loss"] for r in read_metrics(runs / "resumed") if "loss" in r}
    assert resumed[STEPS] == _losses(runs / "fsdp")[STEPS - 1]
    info = [json.loads((runs / "resumed" / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(i["output_tied"] == [True] for i in info)


def test_an_untied_export_does_not_load_into_a_tied_model(tmp_path: Path) -> None:
    """A model-only export (model.pt) of an untied model holds an output matrix a tied model has
    no place for: one line, not a silently dropped tensor; the tied model's own export loads."""
    from types import SimpleNamespace

    from torchtitan_amp.checkpoint.format import EXPORT_FILE
    from torchtitan_amp.checkpoint.loading import load_export
    from torchtitan_amp.checkpoint.ranks import RankLayout
    from torchtitan_amp.core.errors import CheckpointError

    tied = Transformer(TIED_ARGS)
    # One process: all_ok raises this rank's error itself.
    manager = SimpleNamespace(model=tied, model_state_dict=tied.state_dict, ranks=RankLayout(), adapters=set())
    untied = Transformer(dataclasses.replace(TIED_ARGS, enable_weight_tying=False))
    torch.save(untied.state_dict(), tmp_path / EXPORT_FILE)
    with pytest.raises(CheckpointError, match=r"does not fit this model: the model has no 'output.weight'") as e:
        load_export(manager, tmp_path)
    assert "\n" not in str(e.value)
    source = Transformer(TIED_ARGS)
    torch.save(source.state_dict(), tmp_path / EXPORT_FILE)
    load_export(manager, tmp_path)
    assert _tied(tied) and torch.equal(tied.tok_embeddings.weight, source.tok_embeddings.weight)
