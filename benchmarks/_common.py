"""Shared pieces of the CPU benchmarks: models, torchrun launches of a worker (and the worker's
loop over trainings), timing, report formatting. Benchmarks run from the repository root as
`python -m benchmarks.NAME`.

Benchmarks are not tests: each prints numbers measured side by side in one run, and ratios between
them, because absolute times on a shared machine vary by 2x from run to run.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from torchtitan_amp.core.environment import require, separate_inductor_cache
from torchtitan_amp.tools.common import load_average, machine, torchrun

require()
separate_inductor_cache()  # before any benchmark imports torch

# The CPU models. "large" is the size at which this CPU's bf16 matmuls pay off (dim 1024, 8
# layers, head dim 64, 103M parameters); the debug model's head dim 16 makes CPU bf16 attention
# slow, so "debug_h64" (same size, 4 heads) shows the debug scale without that artefact. "medium"
# (dim 512, 8 layers, 27M parameters) is where parameter state outweighs small-batch activations.
CPU_MODELS: dict[str, dict[str, Any]] = {
    "debug": {"flavor": "debugmodel"},
    "debug_h64": {"flavor": "debugmodel_h64"},
    "medium": {"flavor": "debugmodel", "replace": {"dim": 512, "n_layers": 8, "n_heads": 8}},
    "large": {"flavor": "debugmodel", "replace": {"dim": 1024, "n_layers": 8, "n_heads": 16}},
    # Smoke runs of the benchmarks' own code (tests), not a speed measurement.
    "tiny": {"flavor": "debugmodel", "replace": {"dim": 64, "n_layers": 2, "n_heads": 4}},
}

# (seq_len, global batch) of each model in the step benchmarks (comm, overhead, precision_speed).
SHAPES = {"debug": (256, 8), "debug_h64": (256, 8), "medium": (512, 4), "large": (512, 2), "tiny": (32, 2)}
_FLAVORS: dict[str, Any] = {}  # the registered flavors before any use_model replaced one


def use_model(name: str) -> list[str]:
    """Make model `name` buildable by the Trainer in this process; returns its config overrides.

    The config accepts only the registered flavors, so "large" replaces the debug flavor's
    shape in this process's flavor table (nothing on disk changes)."""
    from torchtitan_amp.models.llama3 import model as llama

    spec = CPU_MODELS[name]
    # From the registered shape every time: models run one after another in one process.
    original = _FLAVORS.setdefault(spec["flavor"], llama.LLAMA3_FLAVORS[spec["flavor"]])
    llama.LLAMA3_FLAVORS[spec["flavor"]] = dataclasses.replace(original, **spec.get("replace", {}))
    return ["--model.flavor", spec["flavor"]]


def model_args(name: str, vocab_size: int = 258, seq_len: int = 2048):  # type: ignore[no-untyped-def]
    from torchtitan_amp.models.llama3 import model as llama

    use_model(name)
    return llama.build_model_args(CPU_MODELS[name]["flavor"], vocab_size, seq_len)


def num_params(name: str) -> int:
    from torchtitan_amp.memory import ModelDims

    return ModelDims.from_args(model_args(name)).total_params()


def summarize(times: list[float]) -> float:
    """Median step time: robust to the one slow step another process's burst causes."""
    return statistics.median(times)


def run_jobs(module: str, nproc: int, jobs: list[dict[str, Any]], out: Path, name: str) -> list[dict[str, Any]]:
    """Launch `python -m MODULE --worker SPEC OUT` once for all jobs; the worker writes a JSON list of
    results."""
    out.mkdir(parents=True, exist_ok=True)
    spec, result = out / f"{name}_spec.json", out / f"{name}_result.json"
    spec.write_text(json.dumps(jobs, indent=1))
    result.unlink(missing_ok=True)
    rc = torchrun(module, nproc, ["--worker", str(spec), str(result)], out / f"{name}.log")
    if rc != 0 or not result.is_file():
        tail = (out / f"{name}.log").read_text()[-4000:]
        raise RuntimeError(f"{module} worker ({nproc} processes) failed with exit code {rc}:\n{tail}")
    return json.loads(result.read_text())


def header(title: str) -> str:
    return (
        f"## {title}\n\nmachine: {machine()}\nload average at start (1/5/15 min): {load_average()}\n"
        f"date: {time.strftime('%Y-%m-%d %H:%M')}\n"
    )


def emit(text: str, output: str | None) -> None:
    """Print a benchmark's report; with --output FILE, also write it there."""
    print(text)
    if output:
        Path(output).write_text(text)


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
