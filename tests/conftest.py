"""pytest's hooks for the suite: the test tiers. Helpers and tolerances live in tests/support.py."""

from __future__ import annotations

import pytest

# Every process the suite starts inherits this: under AVX2 emulation (ATEN_CPU_CAPABILITY=avx2)
# torch.compile must not reuse kernels compiled natively, or the reverse (see environment.py).
from torchtitan_amp.core.environment import separate_inductor_cache

separate_inductor_cache()


# ---------------------------------------------------------------------------------------------
# Tiers. `unit`: in-process, seconds in all. `dist`: modules that launch training or tool
# processes (torchrun on gloo, fake-backend dry runs). `slow`: the parity sweeps that train every
# layout x precision (minutes). `./scripts/run_tests.sh` (CI) runs all three; `-m unit`,
# `-m "not slow"` select less. A module is tiered whole: most mix a few in-process checks into
# the launches they share fixtures with.
SLOW_MODULES = frozenset({"test_parallelisms", "test_precision_dist", "test_optim_state_dist",
                          "test_context_parallel_dist", "test_moe_dist"})
DIST_MODULES = SLOW_MODULES | {"test_checkpoint", "test_dry_run", "test_gpu_checks", "test_hf", "test_multinode",
                               "test_operations", "test_tools", "test_train_integration", "test_families_dist", "test_validation", "test_audit", "test_fp8", "test_freeze",
                               "test_context_parallel_precision", "test_context_parallel_compose", "test_expert_parallel",
                               "test_hf_moe", "test_elastic", "test_weight_tying", "test_trackers",
                               "test_fault_tolerance"}

# `oldest_torch`: the launched modules that CI runs again on the oldest supported torch (2.11, the
# GPU images'), with every unit test: one step of every layout x precision under the audit, the
# dry run against real collective counts, checkpoints and resume, fp8, freezing, end-to-end runs
# (TORCH_VERSION=2.11.0 ./scripts/run_tests.sh -m "unit or oldest_torch").
OLDEST_TORCH_MODULES = frozenset({"test_audit", "test_dry_run", "test_checkpoint", "test_fp8", "test_freeze",
                                  "test_train_integration"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "unit: in-process tests, no launched processes (seconds)")
    config.addinivalue_line("markers", "dist: launches training or tool processes (torchrun on gloo)")
    config.addinivalue_line("markers", "slow: layout x precision parity sweeps (minutes)")
    config.addinivalue_line("markers", "oldest_torch: launched tests CI also runs on the oldest supported torch")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if module in OLDEST_TORCH_MODULES:
            item.add_marker(pytest.mark.oldest_torch)
        if module in DIST_MODULES:
            item.add_marker(pytest.mark.dist)
        else:
            item.add_marker(pytest.mark.unit)
