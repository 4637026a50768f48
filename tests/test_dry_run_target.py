"""The dry run sizes its target device's job (dry_run.device, default cuda): GPU-only options such
as fp8 all-gather are sized, not refused, with or without torchao on this machine; a real CPU run
(and a dry run told to size a CPU job) still refuses them in one line. And the memory table that
benchmarks/torchtitan_memory.py prints (tools/memory_table.py: our dry run against torchtitan's
published memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch import REPO
from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.lowbit import capability
from torchtitan_amp.tools import memory_table
from torchtitan_amp.train import dry_run
from torchtitan_amp.train import job as job_mod

FSDP2 = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--mixed_precision.enabled",
    "true",
    "--parallelism.data_parallel_shard_degree",
    "2",
    "--dry_run.vocab_size",
    "256",
]
FP8_AG = ["--mixed_precision.fp8", "tensorwise", "--mixed_precision.fp8_all_gather", "true"]
REFUSAL = "'mixed_precision.fp8_all_gather' needs CUDA/nccl: gloo (cpu) cannot all-gather float8 tensors"


def _dry(tmp_path: Path, *extra: str) -> dict:
    return dry_run.run(load_config(["--job.dump_folder", str(tmp_path), *FSDP2, *extra]), world_size=2, write=False)


@pytest.mark.parametrize("torchao", ["converts on meta", "absent: sized by rule"])
def test_dry_run_for_cuda_sizes_fp8_all_gather_at_one_byte_per_parameter(
    tmp_path: Path, torchao: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torchao.startswith("absent"):
        monkeypatch.setattr(capability, "fp8_torchao_missing", lambda recipe=None, all_gather=None: "no torchao")
    elif capability.fp8_torchao_missing("tensorwise", True) is not None:
        pytest.skip("torchao (the [fp8] extra) is not installed")
    bf16, f8 = _dry(tmp_path), _dry(tmp_path, *FP8_AG)
    assert (f8["precision"]["target"], f8["precision"]["fp8_all_gather"]) == ("cuda", True)
    # Every block's Linears run in fp8 (the norms are fp32 groups): its whole unsharded size gathers in fp8.
    blocks = [g for g in f8["fsdp_groups"] if g["kind"] == "block"]
    assert len(blocks) == 4 and all(g["fp8_unsharded_numel"] == g["unsharded_numel"] for g in blocks)
    assert all(g["fp8_unsharded_numel"] == 0 for g in f8["fsdp_groups"] if g["kind"] != "block")  # output: skipped
    # 1 byte per parameter on the wire where bf16 took 2, the same gathers, the rest unchanged.
    ag, ag_bf16 = f8["communication"]["fsdp_all_gather"], bf16["communication"]["fsdp_all_gather"]
    gathers = {g["name"]: 2 if g["reshard_after_forward"] else 1 for g in blocks}
    assert ag["float8_e4m3fn"] == sum(gathers[g["name"]] * g["fp8_unsharded_numel"] for g in blocks)
    assert ag_bf16["bfloat16"] == ag["bfloat16"] + 2 * ag["float8_e4m3fn"]
    assert ag_bf16["float32"] == ag["float32"]
    # The unsharded copies (in use, prefetched) of the largest block are 1 byte per parameter too;
    # its unsharded gradient stays bf16.
    big = max(g["unsharded_numel"] for g in blocks if g["reshard_after_forward"])
    last = next(g["unsharded_numel"] for g in blocks if not g["reshard_after_forward"])
    assert f8["memory"]["transient"]["float8_e4m3fn"] == 2 * big + last
    assert bf16["memory"]["transient"]["bfloat16"] - f8["memory"]["transient"]["bfloat16"] == 2 * (2 * big + last)
    assert f8["memory"]["params"] == bf16["memory"]["params"]  # torchao keeps the fp32 weights


def test_fp8_sizes_agree_with_and_without_torchao(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if capability.fp8_torchao_missing("tensorwise", True) is not None:
        pytest.skip("torchao (the [fp8] extra) is not installed")
    converted = _dry(tmp_path, *FP8_AG)
    monkeypatch.setattr(capability, "fp8_torchao_missing", lambda recipe=None, all_gather=None: "no torchao")
    by_rule = _dry(tmp_path, *FP8_AG)
    for key in ("memory", "communication", "fsdp_groups"):
        assert converted[key] == by_rule[key], key


def test_fp8_all_gather_is_refused_in_one_line_on_a_cpu_run_and_a_cpu_target(tmp_path: Path) -> None:
    config = load_config([*FSDP2, *FP8_AG])
    with pytest.raises(PrecisionError) as real:
        job_mod.resolve(config, 2, "cpu")  # a real run on this machine
    assert REFUSAL in str(real.value) and "\n" not in str(real.value)
    with pytest.raises(PrecisionError) as dry:
        _dry(tmp_path, *FP8_AG, "--dry_run.device", "cpu")
    assert REFUSAL in str(dry.value) and "dry_run.device" in str(dry.value) and "\n" not in str(dry.value)


def test_torchtitan_table_on_one_small_row(tmp_path: Path) -> None:
    row = memory_table.Row(
        "tiny, FSDP 2",
        1.0,
        str(REPO / "train_configs" / "debug_model.toml"),
        2,
        (
            "--model.flavor",
            "debugmodel_tiny",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            *FP8_AG,
        ),
        "fp8",
    )
    ours = memory_table.dry_run_peak(row, str(tmp_path))
    report = dry_run.run(load_config(row.args(str(tmp_path))), world_size=2, write=False)
    assert ours == report["memory"]["peak_estimate"]["configured"] / memory_table.GIB > 0
    table = memory_table.build_table([(row, 0.5), (row, 1.25)]).splitlines()
    assert table[0].startswith("| torchtitan row |") and len(table) == 4
    assert table[2] == "| tiny, FSDP 2 | fp8 | 1.0 | 0.5 | 0.50 |"
    assert table[3].endswith("| 1.2 | **1.25** |")  # above theirs: bold
    assert memory_table.pp_ranks(512, 8) == [0, 64, 128, 192, 256, 320, 384, 448]
