"""The test tiers, declared by each module and checked against what the module launches.

A module declares its tier with `pytestmark` (`pytest.mark.dist`, `[pytest.mark.dist,
pytest.mark.slow]`, ...); conftest.py marks a module without a tier marker `unit`. So that a module
that starts processes cannot become `unit` by saying nothing, `misplaced` reads the module's source
(its imports and the string "torch.distributed.run"):

- one that starts ranks (the rank launchers of tests/support/launch.py, torchrun, multiprocessing)
  must carry a launching tier (`dist`, or `gpu`);
- one that starts any other process (`run_python`, `run_command`, `subprocess`) must declare its
  tier: `unit` where each process is one short command (seconds), else `dist`;
- `slow` modules are `dist` modules too.
"""

from __future__ import annotations

import ast

# A module is in exactly one of these (`slow` with `dist`); `oldest_torch` is an extra selection.
TIERS = frozenset({"unit", "dist", "slow", "gpu"})
LAUNCHING_TIERS = frozenset({"dist", "gpu"})
RANK_LAUNCHERS = frozenset(
    {"run_train", "launch_worker", "spawn_ranks", "torchrun_cmd", "launch_cmd", "run_distributed"}
)
PROCESS_LAUNCHERS = frozenset({"run_python", "run_command"})
RANK_MODULES = frozenset({"multiprocessing", "torch.multiprocessing", "torch.distributed.run"})
PROCESS_MODULES = frozenset({"subprocess"})


def launches(source: str) -> tuple[set[str], set[str]]:
    """(what starts ranks, what starts other processes) that the module's source imports or names."""
    ranks: set[str] = set()
    processes: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                ranks |= {alias.name} & RANK_MODULES
                processes |= {alias.name} & PROCESS_MODULES
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            ranks |= {node.module} & RANK_MODULES
            processes |= {node.module} & PROCESS_MODULES
            if node.module.startswith("tests.support"):
                ranks |= names & RANK_LAUNCHERS
                processes |= names & PROCESS_LAUNCHERS
        elif isinstance(node, ast.Constant) and node.value == "torch.distributed.run":
            ranks.add("torch.distributed.run")
    return ranks, processes


def misplaced(name: str, source: str, declared: set[str]) -> str | None:
    """Why module `name`, whose `pytestmark` declares the tiers `declared`, is in the wrong tier;
    None when it is not."""
    ranks, processes = launches(source)
    if "slow" in declared and "dist" not in declared:
        return f"{name} is marked slow but not dist: pytestmark = [pytest.mark.dist, pytest.mark.slow]"
    if ranks and not declared & LAUNCHING_TIERS:
        return (
            f"{name} starts ranks ({', '.join(sorted(ranks))}) but is not marked dist: "
            "add pytestmark = pytest.mark.dist"
        )
    if processes and not declared & TIERS:
        return (
            f"{name} starts processes ({', '.join(sorted(processes))}) but declares no tier: add "
            "pytestmark = pytest.mark.unit (one short command at a time) or pytest.mark.dist"
        )
    return None
