"""Generation, in-process: the KV cache against full recompute (Llama and the MoE
family, with and without sequence-parallel padding), sampling (seeded, top-k / top-p filtered as
transformers' warpers filter), the samples' sinks, and one-line errors of the tool and the config.
Parity with transformers' generate, TP 2 and generation from checkpoints: tests/test_hf.py;
sample_prompts during training and on every evaluation layout: tests/test_validation.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.eval.generation import (
    ModelRunner,
    Sampling,
    filter_logits,
    generate,
    kv_caches,
    next_token,
    step_logits,
)
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, Attention, Transformer
from torchtitan_amp.models.moe.model import MOE_FLAVORS, MoETransformer
from torchtitan_amp.observability.metrics import MetricsLogger
from torchtitan_amp.tools.generate import main as generate_main
from torchtitan_amp.train import job as job_mod

PROMPT = [256, *b"Hello"]  # BOS + bytes


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine two threads
    per process made each decode step ~30x slower (measured: 24 tokens in 1.0 s vs 0.03 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


NEW = 24
# The no-cache forward and the cached steps compute the same sums in other orders (SDPA over a
# whole matrix vs one query row, matmuls of other shapes): fp32 rounding. Measured at most 1.43e-6
# on logits up to 4.1 (3 ulps of 4.0) over the models below; 1e-5 is ~20 ulps. A cache whose decode
# steps are rotated as if at position 0 errs by 0.046 (tested below).
CACHE_ATOL = 1e-5


def _model(name: str) -> torch.nn.Module:
    if name in MOE_FLAVORS:
        cls, args = MoETransformer, MOE_FLAVORS[name]
    else:
        cls, args = Transformer, LLAMA3_FLAVORS[name]
    torch.manual_seed(0)
    model = cls(dataclasses.replace(args, max_seq_len=64, rope_theta=10000.0))
    model.init_weights()
    # Sharper attention than the init's near-uniform one (scores ~0.03), so that the outputs depend
    # on where each key sits: a cache that got positions wrong must show.
    with torch.no_grad():
        for attention in (m for m in model.modules() if isinstance(m, Attention)):
            attention.wq.weight.mul_(8)
            attention.wk.weight.mul_(8)
    return model.eval()


def _cached_step_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Prefill PROMPT, then feed tokens[len(PROMPT):-1] one at a time: the logits after every
    position from len(PROMPT) - 1 on, [len(tokens) - len(PROMPT), V]."""
    with torch.no_grad(), kv_caches(runner.model, len(tokens) + runner.multiple) as caches:
        steps = [step_logits(runner, torch.tensor([PROMPT]), caches)]
        steps += [step_logits(runner, torch.tensor([[t]]), caches) for t in tokens[len(PROMPT) : -1]]
    return torch.cat(steps)


@pytest.mark.parametrize("flavor", ["debugmodel_tiny", "debugmodel_moe", "debugmodel_qwen3"])
@pytest.mark.parametrize("multiple", [1, 3])
def test_kv_cache_decode_equals_full_recompute(flavor: str, multiple: int) -> None:
    """Every decode step's logits equal those of one forward over the whole text without a
    cache; `multiple` 3 pads every step to 3 tokens (what sequence parallel needs), which the
    lower-right causal mask keeps out of the real tokens' outputs."""
    model = _model(flavor)
    runner = ModelRunner(model, multiple=multiple)
    completion = generate(runner, PROMPT, NEW)
    assert completion.stop == "length" and len(completion.tokens) == NEW
    tokens = PROMPT + completion.tokens
    with torch.no_grad():
        full = model(torch.tensor([tokens]))[0, len(PROMPT) - 1 : -1]
    cached = _cached_step_logits(runner, tokens)
    err = (cached - full).abs().max().item()
    print(f"\n[kv cache] {flavor} multiple {multiple}: max |logit diff| {err:.2e}, max |logit| {full.abs().max():.2f}")
    assert err <= CACHE_ATOL
    # Greedy: each generated token is the argmax of the full forward's logits.
    assert full.argmax(dim=-1).tolist() == completion.tokens
    # The caches are gone: every attention is back to the class's None.
    assert all("kv_cache" not in vars(m) for m in model.modules() if isinstance(m, Attention))


def test_generation_runs_in_the_plans_precision() -> None:
    """A bf16 mixed-precision job's plan: the forward runs under its bf16 autocast (the cache holds
    bf16 keys and values), the logits come out in fp32, and they differ from fp32's by bf16
    rounding (measured 0.0099 on logits up to 3.0: 0.3%, about 2^-8, bf16's 8-bit mantissa; the bound is
    5% of the largest logit)."""
    plan = job_mod.resolve(
        load_config(["--model.flavor", "debugmodel_tiny", "--mixed_precision.enabled", "true"]), 1, "cpu"
    ).plan
    assert plan.autocast_dtype == torch.bfloat16
    model = _model("debugmodel_tiny")
    runner = ModelRunner.for_plan(model, plan, tp=1, sequence_parallel=False)
    with torch.no_grad(), kv_caches(model, 16) as caches:
        logits = step_logits(runner, torch.tensor([PROMPT]), caches)
        assert caches[0].k.dtype == caches[0].v.dtype == torch.bfloat16
    with torch.no_grad():
        fp32 = model(torch.tensor([PROMPT]))[:, -1]
    assert logits.dtype == torch.float32
    assert 1e-4 < (logits - fp32).abs().max() < 0.05 * fp32.abs().max()


def test_a_cache_without_the_rotary_offset_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: decode steps rotated as if at position 0 are far off
    (measured 0.046, 4600 x CACHE_ATOL)."""
    from torchtitan_amp.models.kv_cache import KVCache

    model = _model("debugmodel_tiny")
    tokens = PROMPT + generate(ModelRunner(model), PROMPT, 8).tokens
    with torch.no_grad():
        full = model(torch.tensor([tokens]))[0, len(PROMPT) - 1 : -1]
    monkeypatch.setattr(KVCache, "rotary_rows", lambda self, cos, sin: (cos, sin))
    assert (_cached_step_logits(ModelRunner(model), tokens) - full).abs().max() > 100 * CACHE_ATOL


def test_sampling_is_seeded_and_its_limits_are_greedy() -> None:
    runner = ModelRunner(_model("debugmodel_tiny"))
    greedy = generate(runner, PROMPT, NEW).tokens

    def sampled(**kw: float) -> list[int]:
        return generate(runner, PROMPT, NEW, Sampling(**{"temperature": 1.0, **kw})).tokens

    assert sampled(seed=1) == sampled(seed=1)
    assert sampled(seed=1) != sampled(seed=2) and sampled(seed=1) != greedy
    # Only the likeliest token left to draw: greedy, whatever the seed.
    assert sampled(top_k=1, seed=5) == greedy
    assert sampled(top_p=1e-6, seed=5) == greedy


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(0.7, 5, 0.9), (1.3, 0, 0.5), (1.0, 40, 1.0), (0.5, 3, 0.999), (1.0, 1, 1.0)]
)
def test_filter_equals_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    """Temperature, then top-k, then top-p: the order and the rules of transformers' sampling."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 258, generator=torch.Generator().manual_seed(0)) * 3
    theirs = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    ours = filter_logits(logits, Sampling(temperature, top_k, top_p))
    assert torch.equal(ours.isinf(), theirs.isinf()) and torch.equal(ours, theirs)
    kept = (~ours.isinf()).sum(dim=-1)
    assert (kept >= 1).all() and (top_k == 0 or (kept <= top_k).all())
    # A seeded draw only ever picks a kept token.
    drawn = next_token(logits, Sampling(temperature, top_k, top_p), torch.Generator().manual_seed(1))
    assert not ours.gather(-1, drawn[:, None]).isinf().any()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "--temperature must be >= 0 (0: greedy), got -0.5"),
        ({"top_k": -1}, "--top-k must be >= 0 (0: no top-k), got -1"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1] (1: no top-p), got 0.0"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1] (1: no top-p), got 1.5"),
    ],
)
def test_bad_sampling_is_a_config_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        Sampling(**kwargs)
    assert str(e.value) == message


def test_samples_go_to_the_log_samples_jsonl_and_tensorboard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricsLogger(
        tmp_path,
        log_freq=1,
        enable_tensorboard=True,
        is_logging_rank=True,
        flops_per_token=1,
        peak_flops=1,
        device=torch.device("cpu"),
    )
    samples = [
        {"prompt": "The ", "text": "cat\nsat", "tokens": [99, 97, 116, 10, 115, 97, 116], "stop": "length"},
        {"prompt": "A", "text": "", "tokens": [257], "stop": "eos"},
    ]
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        metrics.log_samples(4, samples)
        metrics.log_samples(8, samples[:1])
    metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [{"step": 4, **samples[0]}, {"step": 4, **samples[1]}, {"step": 8, **samples[0]}]
    lines = [r.message for r in caplog.records]
    assert lines == [
        "step 4 sample 0: 'The ' -> 'cat\\nsat'",
        "step 4 sample 1: 'A' -> ''",
        "step 8 sample 0: 'The ' -> 'cat\\nsat'",
    ]
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("samples/0/text_summary")]
    assert texts == [(4, "The cat\nsat"), (8, "The cat\nsat")]
    # Other ranks write nothing.
    quiet = MetricsLogger(
        tmp_path / "r1",
        log_freq=1,
        enable_tensorboard=False,
        is_logging_rank=False,
        flops_per_token=1,
        peak_flops=1,
        device=torch.device("cpu"),
    )
    quiet.log_samples(4, samples)
    assert not (tmp_path / "r1" / "samples.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# One-line errors


TINY = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "64", "--mixed_precision.enabled", "false"]


def _tool_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert generate_main([*argv]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: "), errors
    return errors[0].removeprefix("error: ")


def test_tool_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    nope, bare = tmp_path / "nope", tmp_path / "bare"
    bare.mkdir()
    cases = {
        ("--hf", str(nope), "--prompt", "x"): f"--hf {nope}: no such folder",
        ("--hf", str(bare), "--prompt", "x"): f"--hf {bare} has no config.json: not a Hugging Face model folder",
        ("--export", str(nope), "--prompt", "x"): f"--export {nope}: no such folder",
        (
            "--checkpoint.step",
            "1",
            "--prompt",
            "x",
            "--top-p",
            "1.5",
        ): "--top-p must be in (0, 1] (1: no top-p), got 1.5",
        (
            "--checkpoint.step",
            "1",
            "--prompt",
            "x",
            "--temperature",
            "-1",
        ): "--temperature must be >= 0 (0: greedy), got -1.0",
        ("--checkpoint.step", "1", "--prompts-file", str(nope)): f"--prompts-file {nope}: cannot read it",
    }
    for argv, message in cases.items():
        assert _tool_error(capsys, *argv, *TINY).startswith(message), argv
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert (
        _tool_error(capsys, "--checkpoint.step", "1", "--prompts-file", str(empty), *TINY)
        == f"--prompts-file {empty} holds no prompt"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n["no"]\n')
    assert (
        _tool_error(capsys, "--checkpoint.step", "1", "--prompts-file", str(bad), *TINY)
        == f'--prompts-file {bad} line 2: expected a JSON object with a "prompt" string'
    )


def test_tool_ignores_the_runs_validation(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run config with sample prompts (validation on) loads: only the missing step is an error."""
    config = tmp_path / "run.toml"
    config.write_text('[validation]\nenable = true\nsample_prompts = ["The "]\n')
    assert _tool_error(
        capsys,
        "--config",
        str(config),
        "--checkpoint.step",
        "3",
        "--prompt",
        "x",
        "--max-new-tokens",
        "8",
        "--job.dump_folder",
        str(tmp_path),
        *TINY,
    ).startswith("checkpoint.load_step = 3: no complete")


def test_tool_checks_lengths_and_steps_before_generating(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = ["--job.dump_folder", str(tmp_path), *TINY]
    # BOS + 40 bytes + 24 new tokens > 64 positions.
    assert _tool_error(capsys, "--checkpoint.step", "1", "--prompt", "x" * 40, "--max-new-tokens", "24", *run) == (
        "prompt 0 has 41 tokens: with --max-new-tokens 24 it does not fit training.seq_len = 64 (the rotary "
        "tables' length); shorten it, generate fewer tokens or raise --training.seq_len"
    )
    assert (
        _tool_error(capsys, "--checkpoint.step", "1", "--prompt", "x", "--max-new-tokens", "0", *run)
        == "--max-new-tokens must be >= 1, got 0"
    )
    assert _tool_error(capsys, "--checkpoint.step", "7", "--prompt", "x", "--max-new-tokens", "8", *run).startswith(
        f"checkpoint.load_step = 7: no complete checkpoint step-7 in {tmp_path / 'checkpoint'}"
    )


BASE = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--validation.enable", "true"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--validation.enable", "false", "--validation.sample_prompts", "a"],
            "'validation.sample_prompts' are generated at every evaluation: set validation.enable = true",
        ),
        (["--validation.sample_max_new_tokens", "0"], "'validation.sample_max_new_tokens' must be >= 1, got 0"),
        (
            ["--validation.sample_temperature", "-1"],
            "'validation.sample_temperature' must be >= 0 (0: greedy), got -1.0",
        ),
    ],
)
def test_bad_sample_fields_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([*BASE, *overrides])
    assert str(e.value) == message


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
            2,
            "'validation.sample_prompts' is not supported with parallelism.pipeline_parallel_degree = 2 "
            "(generation runs whole sequences through the whole model on every rank); leave sample_prompts empty",
        ),
        (
            ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
            2,
            "'validation.sample_prompts' is not supported with parallelism.context_parallel_degree = 2",
        ),
        (
            ["--validation.sample_prompts", "The ," + "x" * 8, "--validation.sample_max_new_tokens", "24"],
            1,
            "'validation.sample_prompts' entry 1 has 9 tokens: with validation.sample_max_new_tokens = 24 it needs 33 "
            "positions, more than training.seq_len = 32; shorten it or generate fewer tokens",
        ),
        (
            [
                "--validation.sample_prompts",
                "The ," + "x" * 7,
                "--validation.sample_max_new_tokens",
                "24",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
            2,
            "'validation.sample_prompts' entry 1 has 8 tokens: with validation.sample_max_new_tokens = 24 + 1 of "
            "sequence-parallel padding it needs 33 positions",
        ),
    ],
)
def test_sample_prompts_refused_where_generation_cannot_run(overrides: list[str], world: int, message: str) -> None:
    config = load_config([*BASE, "--validation.sample_prompts", "The ", *overrides])
    with pytest.raises(ConfigError) as e:
        job_mod.resolve(config, world, "cpu")
    assert str(e.value).startswith(message)


def test_sample_prompts_resolve_to_token_ids() -> None:
    # On the command line a list is comma-separated (items stripped); a TOML list keeps its strings as they are.
    config = load_config(
        [*BASE, "--validation.sample_prompts", "The cat, def", "--validation.sample_max_new_tokens", "8"]
    )
    samples = job_mod.resolve(config, 1, "cpu").validation.samples
    assert samples.prompts == ("The cat", "def") and samples.ids == ((256, *b"The cat"), (256, *b"def"))
    assert samples.max_new_tokens == 8 and samples.sampling.greedy
