"""The one setup path (torchtitan_amp/train/job.py): every config-time check in one place, and the
model parts that the trainer and the dry run both build from it; the torch-free rules module."""

from __future__ import annotations

import pytest
import torch

from tests.support.launch import run_python
from torchtitan_amp import memory
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core import rules
from torchtitan_amp.data import DataError
from torchtitan_amp.train.job import build_model_parts, resolve

pytestmark = pytest.mark.unit

TINY = ("--model.flavor", "debugmodel", "--training.seq_len", "16", "--training.local_batch_size", "2")


def test_resolve_returns_everything_decided_before_a_process_group() -> None:
    config = load_config(
        [
            *TINY,
            "--mixed_precision.enabled",
            "true",
            "--training.global_batch_size",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
        ]
    )
    job = resolve(config, 4, "cpu")  # pp 2 x dp_shard -1 -> 2
    assert (job.dims.pp, job.dims.dp_shard, job.accum, job.n_microbatches) == (2, 2, 2, 2)
    assert job.plan.path == "fsdp" and job.model_args.vocab_size == job.tokenizer.vocab_size
    assert job.layout.grad_accum == 2 and job.layout.split_points == (3,)


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (("--training.global_batch_size", "6"), 2, "'training.global_batch_size' = 6 is not a multiple"),
        (("--parallelism.tensor_parallel_degree", "3"), 3, "must divide the model's n_heads = 16"),
        (
            ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.9"),
            2,
            "'parallelism.pipeline_parallel_split_points' needs 1 increasing layer indices",
        ),
        (("--mixed_precision.lower_precision_safe_modules", "torch.nn.Nope"), 1, "torch.nn.Nope"),
        (("--model.tokenizer", "/no/such/tokenizer.json"), 1, "/no/such/tokenizer.json"),
        (
            ("--debug.fault_inject_at_step", "1", "--debug.fault_inject_rank", "2"),
            2,
            "'debug.fault_inject_rank' = 2 is not a rank of this job",
        ),
    ],
)
def test_resolve_refuses_bad_configs_naming_the_field(argv: tuple[str, ...], world: int, message: str) -> None:
    with pytest.raises((ConfigError, DataError), match=message.replace("(", r"\(").replace(".", r"\.")):
        resolve(load_config([*TINY, *argv]), world, "cpu")


def test_pipeline_split_and_stage_placement_come_from_the_job() -> None:
    config = load_config(
        [
            *TINY,
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ]
    )
    job = resolve(config, 2, "cpu")
    assert job.boundaries == (0, 2, 4, 5) and job.num_stages == 4 and job.n_microbatches == 2
    assert job.stage_ids(0) == [0, 2] and job.stage_ids(1) == [1, 3]
    assert [list(r) for r in rules.stage_layer_ranges(6, 4, job.boundaries[1:])] == [[0, 1], [2, 3], [4], [5]]


def test_dry_run_parts_are_the_trainers_parts_on_meta() -> None:
    """The dry run's meta model is what the trainer trains: same names, shapes and dtypes."""
    config = load_config([*TINY, "--mixed_precision.enabled", "true"])
    job = resolve(config, 1, "cpu")
    real = build_model_parts(job, torch.device("cpu"), [0])
    meta = build_model_parts(job, torch.device("meta"), [0], materialize=False)
    assert real.num_params == meta.num_params and real.flops_per_token == meta.flops_per_token

    def shapes(part: torch.nn.Module) -> dict[str, tuple]:
        return {n: (tuple(p.shape), p.dtype) for n, p in part.named_parameters()}

    assert shapes(real.parts[0]) == shapes(meta.parts[0])
    assert all(p.is_meta for p in meta.parts[0].parameters())
    assert not any(p.is_meta for p in real.parts[0].parameters()) and real.parts[0].training


def test_every_rank_initialises_identical_weights_from_the_seed() -> None:
    config = load_config([*TINY, "--training.seed", "7"])
    job = resolve(config, 1, "cpu")
    a = build_model_parts(job, torch.device("cpu"), [0]).parts[0]
    torch.manual_seed(123)  # whatever the global RNG held before
    b = build_model_parts(job, torch.device("cpu"), [0]).parts[0]
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_dry_run_with_a_vocab_size_reads_no_tokenizer() -> None:
    config = load_config([*TINY, "--model.tokenizer", "/cluster/only/tokenizer.json", "--dry_run.vocab_size", "1000"])
    job = resolve(config, 1, "cpu", dry_run=True)
    assert job.tokenizer is None and job.model_args.vocab_size == 1000


def test_reshard_after_forward_follows_torchtitan_under_pp() -> None:
    assert rules.reshard_after_forward("default", False, False) is True
    assert rules.reshard_after_forward("default", True, False) is False
    # Under PP each stage runs forward once per microbatch: resharding would gather every time.
    assert rules.reshard_after_forward("default", False, True) is False
    assert rules.reshard_after_forward("always", True, True) is True
    assert rules.reshard_after_forward("never", False, False) is False


def test_rules_memory_and_config_import_no_torch() -> None:
    code = (
        "import sys; import torchtitan_amp.core.rules, torchtitan_amp.memory, torchtitan_amp.config, "
        "torchtitan_amp.core.environment; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.describe()


def test_analytic_and_runtime_share_the_rules() -> None:
    assert memory.DTYPE_BYTES is rules.DTYPE_BYTES and memory.STAGES_PER_RANK is rules.STAGES_PER_RANK
    for name, size in rules.DTYPE_BYTES.items():  # the analytic sizes are torch's
        assert torch.empty((), dtype=getattr(torch, name)).element_size() == size
        assert rules.dtype_name(getattr(torch, name)) == name
    # Every schedule the config accepts has a placement, and no placement lacks a config value.
    assert set(rules.STAGES_PER_RANK) == set(rules.PP_SCHEDULES)
