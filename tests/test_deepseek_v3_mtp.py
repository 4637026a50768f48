"""DeepSeek-V3's multi-token prediction beyond its formula (tests/test_deepseek_v3.py): the
layouts it refuses, document boundaries under block-causal packing, and its memory terms. Its
FSDP 2 and EP 2 runs against one process: tests/test_moe_dist.py."""

from __future__ import annotations

import pytest

from torchtitan_amp.config import ConfigError
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models.deepseek_v3.model import DEEPSEEK_V3_FLAVORS
from torchtitan_amp.train.parallelize import check_mtp

MTP_FLAVOR = DEEPSEEK_V3_FLAVORS["debugmodel_mtp"]


@pytest.mark.parametrize(
    "dims,option,why",
    [
        (ParallelDims(1, 1, 2, 1, 2), "tensor_parallel_degree", "its depths are not in the TP plan"),
        (ParallelDims(1, 1, 1, 2, 2), "pipeline_parallel_degree", "a depth needs the first stage's embeddings"),
        (ParallelDims(1, 1, 1, 1, 2, cp=2), "context_parallel_degree", "depth k shifts each sequence"),
    ],
)
def test_mtp_refuses_tp_pp_cp_in_one_line(dims, option, why):
    with pytest.raises(ConfigError) as e:
        check_mtp(MTP_FLAVOR, dims, "debugmodel_mtp")
    message = str(e.value)
    assert "\n" not in message and f"'parallelism.{option}' = 2 cannot train model.flavor 'debugmodel_mtp'" in message
    assert "runs on FSDP, HSDP, DDP and EP" in message and why in message, message


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(1, 2, 1, 1, 2),
        ParallelDims(2, 2, 1, 1, 4),
        ParallelDims(2, 1, 1, 1, 2),
        ParallelDims(1, 2, 1, 1, 2, ep=2),
    ],
)
def test_mtp_runs_on_data_and_expert_parallel(dims):
    """FSDP, HSDP, DDP and EP take it (FSDP 2 and EP 2 trained against one process in
    tests/test_moe_dist.py); without MTP nothing is refused."""
    check_mtp(MTP_FLAVOR, dims, "debugmodel_mtp")
    check_mtp(DEEPSEEK_V3_FLAVORS["debugmodel"], ParallelDims(1, 1, 2, 2, 4, cp=1), "debugmodel")
