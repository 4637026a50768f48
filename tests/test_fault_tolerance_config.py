"""[fault_tolerance] without starting anything: its bounds and cross-field rules, the one-line
error when torchft is missing, each replica group's share of the data, the precision plan's
cross-group all-reduce, and the extra's pin. The launches are in test_fault_tolerance.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from torchtitan_amp.config import ConfigError, help_text, load_config
from torchtitan_amp.core import environment
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.precision.report import fault_tolerance_summary
from torchtitan_amp.train.fault_tolerance import data_position, group_config

ON = ("--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2")


def test_off_by_default_and_in_help() -> None:
    ft = load_config([]).fault_tolerance
    assert not ft.enable and ft.semi_sync_method == "none" and ft.process_group == "auto"
    assert "--fault_tolerance.min_replica_size" in help_text()


def test_the_default_collective_timeout_outlasts_a_heal() -> None:
    """The survivors' first cross-group collective after a heal waits for the healing group, which
    joins it only once it has copied and loaded the live state: a heal slower than
    process_group_timeout_ms fails that collective and the survivors discard their step (their
    DiLoCo sync). A rank of Llama 3 8B on FSDP 8 heals 1e9 parameters x (fp32 weights + 2 AdamW
    moments + DiLoCo's fp32 global weights and momentum) = 20 GB; at 1 GB/s over torchft's HTTP
    transport, 20 s: the default leaves 3x that."""
    heal_s = 1e9 * (4 + 8 + 8) / 1e9
    assert load_config([]).fault_tolerance.process_group_timeout_ms >= 3 * heal_s * 1000


@pytest.mark.parametrize(
    "args, message",
    [
        (("--fault_tolerance.enable", "true"), "'fault_tolerance.group_size' must be the number of replica groups"),
        ((*ON, "--fault_tolerance.replica_id", "2"), "'fault_tolerance.replica_id' = 2 must be below"),
        ((*ON, "--fault_tolerance.min_replica_size", "3"), "'fault_tolerance.min_replica_size' = 3 is more than"),
        (
            (*ON, "--fault_tolerance.pseudo_gradient_dtype", "bfloat16"),
            "'fault_tolerance.pseudo_gradient_dtype' = 'bfloat16' applies to semi_sync_method = 'diloco'",
        ),
        ((*ON, "--fault_tolerance.sync_steps", "10"), "'fault_tolerance.sync_steps' = 10 applies to semi_sync_method"),
        ((*ON, "--fault_tolerance.outer_lr", "0.5"), "'fault_tolerance.outer_lr' = 0.5 applies to semi_sync_method"),
        (
            (*ON, "--fault_tolerance.semi_sync_method", "diloco", "--parallelism.tensor_parallel_degree", "2"),
            "'parallelism.tensor_parallel_degree' = 2",
        ),
        (("--fault_tolerance.pseudo_gradient_dtype", "float16"), "fault_tolerance.pseudo_gradient_dtype"),
        (("--fault_tolerance.outer_momentum", "1.0"), "fault_tolerance.outer_momentum"),
        (("--fault_tolerance.outer_lr", "0"), "fault_tolerance.outer_lr"),
        ((*ON, "--parallelism.data_parallel_replicate_degree", "2"), "torchft owns the replicate dimension"),
        ((*ON, "--parallelism.tensor_parallel_degree", "2"), "'parallelism.tensor_parallel_degree' = 2"),
        ((*ON, "--checkpoint.enable", "true", "--checkpoint.async_mode", "async"), "'checkpoint.async_mode' = 'async'"),
        ((*ON, "--checkpoint.create_seed_checkpoint", "true"), "'checkpoint.create_seed_checkpoint' runs without"),
        (
            (
                *ON,
                "--checkpoint.enable",
                "true",
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--checkpoint.interval",
                "7",
            ),
            "'checkpoint.interval' = 7 must be a multiple of fault_tolerance.sync_steps = 5",
        ),
        (("--fault_tolerance.replica_id", "-1"), "fault_tolerance.replica_id"),
        (("--fault_tolerance.process_group", "mpi"), "fault_tolerance.process_group"),
        (
            ("--fault_tolerance.semi_sync_method", "diloco"),
            "'fault_tolerance.semi_sync_method' = 'diloco' needs fault_tolerance.enable = true",
        ),
        (
            (*ON, "--fault_tolerance.lighthouse", "127.0.0.1"),
            "'fault_tolerance.lighthouse' = '127.0.0.1' must be a URL http://HOST:PORT",
        ),
        (
            (*ON, "--fault_tolerance.lighthouse", "http://127.0.0.1"),
            "'fault_tolerance.lighthouse' = 'http://127.0.0.1' must be a URL http://HOST:PORT",
        ),
    ],
)
def test_rules_name_the_field(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(list(args))


def test_diloco_is_accepted_with_its_settings() -> None:
    ft = load_config(
        [
            *ON,
            "--fault_tolerance.semi_sync_method",
            "diloco",
            "--fault_tolerance.sync_steps",
            "10",
            "--fault_tolerance.pseudo_gradient_dtype",
            "bfloat16",
            "--fault_tolerance.outer_lr",
            "0.5",
            "--fault_tolerance.outer_momentum",
            "0.8",
        ]
    ).fault_tolerance
    assert (ft.semi_sync_method, ft.sync_steps, ft.pseudo_gradient_dtype, ft.outer_lr, ft.outer_momentum) == (
        "diloco",
        10,
        "bfloat16",
        0.5,
        0.8,
    )


@pytest.mark.parametrize(
    "address",
    ["http://127.0.0.1:29510", "http://node-1.cluster:29510/", "http://[::1]:29510", "https://lighthouse.example:443"],
)
def test_lighthouse_urls_are_accepted(address: str) -> None:
    assert load_config([*ON, "--fault_tolerance.lighthouse", address]).fault_tolerance.lighthouse == address


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_process_group_auto_follows_the_training_device(device: str, backend: str) -> None:
    from torchtitan_amp.train.fault_tolerance import process_group_backend

    assert process_group_backend(load_config(list(ON)).fault_tolerance, device) == backend
    gloo = load_config([*ON, "--fault_tolerance.process_group", "gloo"]).fault_tolerance
    assert process_group_backend(gloo, device) == "gloo"


def test_nccl_without_cuda_is_one_line() -> None:
    from torchtitan_amp.train.fault_tolerance import process_group_backend

    nccl = load_config([*ON, "--fault_tolerance.process_group", "nccl"]).fault_tolerance
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "'fault_tolerance.process_group' = 'nccl' needs CUDA; this job trains on cpu: use 'gloo' or 'auto'"
        ),
    ) as e:
        process_group_backend(nccl, "cpu")
    assert "\n" not in str(e.value)


def test_a_missing_or_bad_lighthouse_address_is_one_line(monkeypatch) -> None:
    from torchtitan_amp.train.fault_tolerance import lighthouse_address

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    ft = load_config(list(ON)).fault_tolerance
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "fault_tolerance.enable needs torchft's lighthouse: set fault_tolerance.lighthouse or TORCHFT_LIGHTHOUSE"
        ),
    ):
        lighthouse_address(ft)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "localhost:29510")
    with pytest.raises(
        ConfigError, match=re.escape("TORCHFT_LIGHTHOUSE = 'localhost:29510' must be a URL http://HOST:PORT")
    ):
        lighthouse_address(ft)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    assert lighthouse_address(ft) == "http://localhost:29510"
    assert (
        lighthouse_address(load_config([*ON, "--fault_tolerance.lighthouse", "http://h:1"]).fault_tolerance)
        == "http://h:1"
    )


def test_rules_apply_only_when_on() -> None:
    load_config(["--fault_tolerance.replica_id", "5", "--parallelism.data_parallel_replicate_degree", "2"])


def test_checkpoints_are_allowed() -> None:
    assert load_config([*ON, "--checkpoint.enable", "true"]).checkpoint.enable


def test_missing_torchft_is_one_line_naming_the_install(monkeypatch, capsys) -> None:
    from torchtitan_amp import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    assert main.main(list(ON)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 'fault_tolerance.enable' needs torchft")
    assert environment.TORCHFT_INSTALL in err[0]


def test_the_extra_pins_what_the_error_says_to_install() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    pin = environment.TORCHFT_INSTALL.removeprefix("pip install ")
    assert f'ft = ["{pin}"]' in pyproject


def test_each_group_reads_its_own_share_of_the_global_order() -> None:
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, world_size=2)
    positions = {
        data_position(load_config([*ON, "--fault_tolerance.replica_id", str(g)]), dims, r)
        for g in (0, 1)
        for r in (0, 1)
    }
    assert positions == {(0, 4), (1, 4), (2, 4), (3, 4)}
    assert data_position(load_config([]), dims, 1) == (1, 2)


def test_plan_reports_the_cross_group_allreduce() -> None:
    import torch

    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, world_size=2)
    plan = PrecisionPlan.from_config(load_config([*ON, "--mixed_precision.enabled", "true"]), dims, "cpu", probe=None)
    assert fault_tolerance_summary(plan)["replica_groups"] == 2
    # The group's reduce dtype crosses groups as it is: no second rounding, no extra bytes.
    assert plan.cross_group_dtype(torch.bfloat16) == torch.bfloat16
    assert plan.cross_group_dtype(torch.float32) == torch.float32
    with pytest.raises(ConfigError, match="float16 loss scaling is not supported with fault_tolerance"):
        PrecisionPlan.from_config(
            load_config([*ON, "--mixed_precision.enabled", "true", "--mixed_precision.param_dtype", "float16"]),
            dims,
            "cpu",
            probe=None,
        )
    off = PrecisionPlan.from_config(load_config([]), ParallelDims(1, 1, 1, 1, 1), "cpu", probe=None)
    assert fault_tolerance_summary(off) is None


@pytest.mark.parametrize("shard", [2, 1])
def test_memory_model_prices_the_cross_group_allreduce_as_the_replicate_one(shard: int) -> None:
    """torchft's all-reduce moves what HSDP's (FSDP) or DDP's (one-rank groups) would over a
    replicate dimension of the same size."""
    import dataclasses

    from torchtitan_amp import memory
    from torchtitan_amp.train.job import resolve

    config = load_config(
        [
            *ON,
            "--model.flavor",
            "debugmodel_tiny",
            "--training.seq_len",
            "64",
            "--dry_run.vocab_size",
            "258",
            "--mixed_precision.enabled",
            "false",
        ]
    )
    job = resolve(config, shard, "cpu", dry_run=True)
    ft = memory.grad_comm(job.model_dims, job.precision, job.layout)["ft_cross_group_all_reduce"]
    replicated = dataclasses.replace(job.layout, dp_replicate=2, replica_groups=1)
    plain = memory.grad_comm(job.model_dims, job.precision, replicated)
    assert ft == plain["hsdp_all_reduce" if shard > 1 else "ddp_all_reduce"]


def test_dry_run_prices_diloco_per_sync_not_per_step(tmp_path: Path) -> None:
    """Under DiLoCo the per-step cross-group all-reduce is gone; a sync moves this rank's shard of
    every trained parameter once in the pseudo-gradient dtype, and the fp32 global weights and
    momentum (2 x 4 bytes per local parameter) join the peak."""
    from torchtitan_amp.train import dry_run

    base = [
        *ON,
        "--model.flavor",
        "debugmodel_tiny",
        "--training.seq_len",
        "64",
        "--dry_run.vocab_size",
        "258",
        "--job.dump_folder",
        str(tmp_path),
    ]
    every_step = dry_run.run(load_config(base), world_size=2, rank=0, write=False)
    diloco = dry_run.run(
        load_config(
            [
                *base,
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--fault_tolerance.sync_steps",
                "10",
                "--fault_tolerance.pseudo_gradient_dtype",
                "bfloat16",
            ]
        ),
        world_size=2,
        rank=0,
        write=False,
    )
    assert "ft_cross_group_all_reduce" in every_step["communication"] and every_step["diloco"] is None
    assert "ft_cross_group_all_reduce" not in diloco["communication"]
    params = diloco["memory"]["params"]["float32"]  # every parameter trained, fp32 storage
    assert diloco["diloco"]["bytes_per_sync"] == {"bfloat16": params // 2}
    assert diloco["diloco"]["bytes_per_step"] == round(params / 2 / 10)
    assert diloco["diloco"]["outer_state"] == {"float32": 2 * params}
    assert (
        diloco["memory"]["peak_estimate"]["configured"]
        == every_step["memory"]["peak_estimate"]["configured"] + 2 * params
    )


def test_memory_model_bounds_a_diloco_sync_by_its_chunks() -> None:
    """A sync holds its wire buffer (this rank's shard in the pseudo-gradient dtype) and at most 3
    chunks of the outer-state dtype (train/diloco.py's CHUNK_ELEMENTS), after the step's activations
    are gone: 8B on FSDP 8 (1e9 local parameters) with bf16 pseudo-gradients, 2 GB + 192 MiB instead
    of three shard-sized temporaries (10 GB)."""
    from torchtitan_amp import memory
    from torchtitan_amp.train.diloco import CHUNK_ELEMENTS

    assert CHUNK_ELEMENTS == 1 << 24
    outer, sync = memory.diloco_bytes(10**9, "bfloat16", "float32", CHUNK_ELEMENTS)
    assert outer == {"float32": 8 * 10**9}
    assert sync == {"bfloat16": 2 * 10**9, "float32": 3 * 4 * CHUNK_ELEMENTS}
    assert memory.diloco_bytes(1000, "float32", "float32", CHUNK_ELEMENTS)[1] == {"float32": 4000 + 3 * 4 * 1000}
    # The peak is the larger of training's and the sync's (state + outer state + the sync's buffers).
    assert memory.peak_with_diloco({"a": 100, "b": 10}, outer, sync, state_total=0) == {
        "a": 100 + 8 * 10**9 + max(0, 2 * 10**9 + 12 * CHUNK_ELEMENTS - 100),
        "b": 10 + 8 * 10**9 + max(0, 2 * 10**9 + 12 * CHUNK_ELEMENTS - 10),
    }


def test_groups_launched_with_one_dump_folder_write_apart_and_share_checkpoints(tmp_path: Path) -> None:
    configs = [
        group_config(load_config([*ON, "--fault_tolerance.replica_id", str(g), "--job.dump_folder", str(tmp_path)]))
        for g in (0, 1)
    ]
    assert [c.job.dump_folder for c in configs] == [str(tmp_path / "replica_0"), str(tmp_path / "replica_1")]
    assert {c.checkpoint.folder for c in configs} == {str(tmp_path / "checkpoint")}
    plain = load_config(["--job.dump_folder", str(tmp_path)])
    assert group_config(plain) is plain


class _Done:
    def wait(self) -> None:
        pass


class _PeerManager:
    """torchft's Manager against one peer group whose gradients are 3g + 1 of this group's:
    allreduce averages with them elementwise, in the tensor's (wire) dtype, as gloo does for two
    groups (a + b is b + a, exactly)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, int]] = []

    def allreduce(self, t):
        self.calls.append((t.dtype, t.numel()))
        t.add_(t * 3 + 1).div_(2)
        return _Done()


@pytest.mark.parametrize("wire", ["same", "bfloat16"])
def test_one_rank_groups_allreduce_buckets_bit_identical_to_per_tensor(monkeypatch, wire: str) -> None:
    """FaultTolerance.allreduce_grads with 1 KiB buckets: one collective per bucket (per wire
    dtype, a gradient over the cap alone and in place), and every gradient exactly what one
    all-reduce of it alone gives."""
    import types

    import torch

    from torchtitan_amp.train import fault_tolerance as ftmod

    torch.manual_seed(0)
    shapes = [(10, 10), (100,), (4, 25), (300,), (7,)]
    grads = [torch.randn(s) for s in shapes] + [torch.randn(50).to(torch.bfloat16)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    wire_dtype = (lambda d: d) if wire == "same" else (lambda d: torch.bfloat16)
    expected = []
    for g in grads:
        w = g.to(wire_dtype(g.dtype))
        expected.append(w.add_(w * 3 + 1).div_(2).to(g.dtype))
    ft = ftmod.FaultTolerance(
        load_config(list(ON)).fault_tolerance,
        types.SimpleNamespace(cross_group_dtype=wire_dtype),
        manager=_PeerManager(),
    )
    monkeypatch.setattr(ftmod, "BUCKET_BYTES", 1024)
    ft.allreduce_grads(params)
    for p, e in zip(params, expected):
        assert torch.equal(p.grad, e)
    f32, bf16 = torch.float32, torch.bfloat16
    if wire == "same":  # 256 fp32 elements a bucket: [100, 100], [100], [300] alone, [7]; bf16 apart
        assert ft.manager.calls == [(f32, 200), (f32, 100), (f32, 300), (f32, 7), (bf16, 50)]
    else:  # 512 bf16 elements a bucket, every gradient on a bf16 wire: [100, 100, 100], [300, 7, 50]
        assert ft.manager.calls == [(bf16, 300), (bf16, 357)]


@pytest.mark.parametrize("retries, passed", [("2", 2), ("-1", None)])
def test_max_retries_reaches_torchft_and_giving_up_is_one_line(monkeypatch, retries: str, passed) -> None:
    """fault_tolerance.max_retries is torchft's Manager(max_retries) (-1: None, never); when the
    Manager gives up, the group stops with one line naming the field (exit code 1)."""
    torchft = pytest.importorskip("torchft")
    from torchtitan_amp.core.errors import ReplicaGroupGaveUp
    from torchtitan_amp.train.fault_tolerance import FaultTolerance

    seen: dict = {}

    class GivingUpManager:
        def __init__(self, **kwargs) -> None:
            seen.update(kwargs)

        def should_commit(self) -> bool:
            raise RuntimeError("should_commit failed 3 times consecutively, exceeding max_retries=2")

    monkeypatch.setattr(torchft, "Manager", GivingUpManager)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    ft = FaultTolerance(load_config([*ON, "--fault_tolerance.max_retries", retries]).fault_tolerance, plan=None)
    assert seen["max_retries"] == passed
    with pytest.raises(
        ReplicaGroupGaveUp,
        match=r"^replica group 0 failed to commit .* in a row "
        r"\(fault_tolerance.max_retries = " + retries,
    ) as e:
        ft.should_commit()
    assert e.value.exit_code == 1 and "\n" not in str(e.value)


def test_dry_run_reduces_once_per_step_under_accumulation(tmp_path: Path) -> None:
    """Per-step fault tolerance with FSDP 2 and 2 micro-batches: gradient sync is off until the
    last one, so the reduce-scatter and the cross-group all-reduce run once per step (as with one
    micro-batch), and every group's unsharded gradient (reduce dtype: fp32, as many bytes as one
    reduce-scatter's input) is held across the micro-batches."""
    from torchtitan_amp.train import dry_run

    base = [
        *ON,
        "--model.flavor",
        "debugmodel_tiny",
        "--training.seq_len",
        "64",
        "--dry_run.vocab_size",
        "258",
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(tmp_path),
    ]
    one, two = (
        dry_run.run(load_config([*base, *extra]), world_size=2, rank=0, write=False)
        for extra in ([], ["--training.global_batch_size", "8"])
    )
    for key in ("fsdp_reduce_scatter", "ft_cross_group_all_reduce"):
        assert two["communication"][key] == one["communication"][key], key
    gathers = one["communication"]["fsdp_all_gather"]
    assert two["communication"]["fsdp_all_gather"] == {dtype: 2 * n for dtype, n in gathers.items()}
    held = two["memory"]["peak_estimate"]["configured"] - one["memory"]["peak_estimate"]["configured"]
    assert held == one["communication"]["fsdp_reduce_scatter"]["float32"]


def test_a_diloco_sync_of_a_moe_model_also_carries_its_expert_biases(tmp_path: Path) -> None:
    """DiLoCo averages the floating-point persistent buffers (MoE's expert biases, whole on every
    rank) with the pseudo-gradient: the dry run's bytes per sync count them too."""
    import torch

    from torchtitan_amp.models import get_family
    from torchtitan_amp.models.spec import synced_buffer_elements
    from torchtitan_amp.train import dry_run

    config = load_config(
        [
            *ON,
            "--model.name",
            "moe",
            "--model.flavor",
            "debugmodel_moe",
            "--training.seq_len",
            "32",
            "--dry_run.vocab_size",
            "258",
            "--job.dump_folder",
            str(tmp_path),
            "--fault_tolerance.semi_sync_method",
            "diloco",
            "--fault_tolerance.sync_steps",
            "10",
        ]
    )
    result = dry_run.run(config, world_size=1, rank=0, write=False)
    family = get_family("moe")
    with torch.device("meta"):
        model = family.build_model(family.build_args("debugmodel_moe", 258, 32))
    buffers = synced_buffer_elements([model])
    assert buffers > 0
    params = sum(p.numel() for p in model.parameters())
    assert result["diloco"]["bytes_per_sync"] == {"float32": 4 * (params + buffers)}
