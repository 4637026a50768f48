"""pytest's hooks for the suite: the test tiers. Helpers and tolerances live in tests/support/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf import save_hf_export
from tests.support.tiers import TIERS, misplaced

# Every process the suite starts inherits this: under AVX2 emulation (ATEN_CPU_CAPABILITY=avx2)
# torch.compile must not reuse kernels compiled natively, or the reverse (see environment.py).
from torchtitan_amp.core.environment import separate_inductor_cache

separate_inductor_cache()


# ---------------------------------------------------------------------------------------------
# Tiers. `unit`: in-process, seconds in all. `dist`: modules that launch training or tool
# processes (torchrun on gloo, fake-backend dry runs). `slow`: the parity sweeps that train every
# layout x precision (minutes). `gpu`: the checks for one CUDA
# GPU (tests/gpu/: its conftest skips them without CUDA unless GPU_CHECKS_DEVICE asks for the CPU trial).
# `./scripts/run_tests.sh` (CI) runs them all; `-m unit`, `-m "not slow"` select less. A module is
# tiered whole, by its `pytestmark` (most mix a few in-process checks into the launches they share
# fixtures with); one without a tier marker is `unit`, and tests/support/tiers.py refuses a module
# that launches processes without declaring a tier that allows it.
#
# `oldest_torch`: the launched modules that CI runs again on the oldest supported torch (2.11, the
# GPU images'), with every unit test: one step of every layout x precision under the audit, the
# dry run against real collective counts, checkpoints and resume, fp8, freezing, end-to-end runs
# (TORCH_VERSION=2.11.0 ./scripts/run_tests.sh -m "unit or oldest_torch").


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "unit: in-process tests, no launched processes (seconds)")
    config.addinivalue_line("markers", "dist: launches training or tool processes (torchrun on gloo)")
    config.addinivalue_line("markers", "slow: layout x precision parity sweeps (minutes)")
    config.addinivalue_line("markers", "oldest_torch: launched tests CI also runs on the oldest supported torch")


def _declared(module: object) -> set[str]:
    marks = getattr(module, "pytestmark", [])
    return {m.name for m in (marks if isinstance(marks, list) else [marks])} & TIERS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems: dict[str, str] = {}
    for item in items:
        module = item.module
        if module is not None and module.__name__ not in problems and module.__file__:
            why = misplaced(module.__name__, Path(module.__file__).read_text(), _declared(module))
            problems[module.__name__] = why or ""
        if not {m.name for m in item.iter_markers()} & TIERS:
            item.add_marker(pytest.mark.unit)
    if found := [why for why in problems.values() if why]:
        raise pytest.UsageError("test tiers:\n" + "\n".join(found))


@pytest.fixture(scope="module")
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(folder, model, reference logits) of the module's `HF_EXPORT` (tests/support/hf.py), saved once per module."""
    return save_hf_export(request.module.HF_EXPORT, tmp_path_factory.mktemp("hf"))
