"""The tiers come from each module's `pytestmark` (tests/conftest.py), checked against what the
module launches (tests/support/tiers.py): a module that starts ranks or processes cannot end up
`unit` by declaring nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiers import launches, misplaced

LAUNCHES_RANKS = "from tests.support.launch import by_step, launch_worker\n"
RUNS_A_SCRIPT = "from tests.support.launch import run_python\n"
TORCHRUN = 'CMD = ["python", "-m", "torch.distributed.run", "train.py"]\n'


@pytest.mark.parametrize(
    "source",
    [
        LAUNCHES_RANKS,
        TORCHRUN,
        "import torch.multiprocessing as mp\n",
        "from tests.support.launch import run_distributed\n",
    ],
)
def test_a_module_that_starts_ranks_must_be_dist(source: str) -> None:
    assert "not marked dist" in misplaced("test_x", source, set())
    assert "not marked dist" in misplaced("test_x", source, {"unit"})
    assert misplaced("test_x", source, {"dist"}) is None


@pytest.mark.parametrize("source", [RUNS_A_SCRIPT, "import subprocess\n", "from subprocess import run\n"])
def test_a_module_that_starts_a_process_must_declare_its_tier(source: str) -> None:
    assert "declares no tier" in misplaced("test_x", source, set())
    assert misplaced("test_x", source, {"unit"}) is None
    assert misplaced("test_x", source, {"dist"}) is None


def test_an_in_process_module_needs_no_marker_and_slow_needs_dist() -> None:
    assert launches("from tests.support.launch import by_step, read_metrics\nimport torch\n") == (set(), set())
    assert misplaced("test_x", "import torch\n", set()) is None
    assert "not dist" in misplaced("test_x", "", {"slow"})
    assert misplaced("test_x", LAUNCHES_RANKS, {"dist", "slow"}) is None


def test_every_launching_module_of_the_suite_declares_its_tier() -> None:
    """What the collection hook enforces, over the suite's files (read, not imported)."""
    ranks = {p.stem for p in Path(__file__).parent.glob("test_*.py") if launches(p.read_text())[0]}
    assert {"test_checkpoint", "test_parallelisms", "test_hf", "test_hf_moe", "test_fault_tolerance"} <= ranks
    for name in ranks:
        assert "pytest.mark.dist" in (Path(__file__).parent / f"{name}.py").read_text(), name
