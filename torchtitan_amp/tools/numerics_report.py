"""The numerics matrix's reports (torchtitan_amp/tools/numerics_matrix.py trains the runs): the
markdown table of each run's loss against the fp32 single-process reference, the tail table of the
last steps' mean loss against a baseline, the JSON of every run's per-step losses for the figures,
and `--diff`, the bit-for-bit comparison of two output folders."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan_amp.tools.numerics_runs import Result, Run


def fmt(x: float, spec: str = ".2e") -> str:
    return "nan" if math.isnan(x) else format(x, spec)


def max_diff(a: dict[int, float], b: dict[int, float]) -> tuple[float, float]:
    """(max abs, max rel) difference over common steps."""
    steps = sorted(a.keys() & b.keys())
    diffs = [abs(a[s] - b[s]) for s in steps]
    rels = [abs(a[s] - b[s]) / max(abs(a[s]), abs(b[s]), 1e-12) for s in steps]
    if any(math.isnan(d) for d in diffs):
        return math.nan, math.nan
    return max(diffs, default=0.0), max(rels, default=0.0)


def table(results: dict[str, Result], runs: list[Run], steps: int) -> str:
    """One row per run; "single" means the one-process run of the row's model (MoE rows: MoE
    single), and a model with routers shows its router_dtype after the path.

    Args:
        results: each run's result by its label ('layout / precision').
        runs: the runs, in the table's order (a run without a result is left out).
        steps: the steps each run trained.
    """
    lines = [
        "| layout | precision | path | final loss | Δ final vs fp32 single | max \\|Δ\\| over steps vs fp32 single "
        "(rel) | max \\|Δ\\| vs same precision, single | skipped fp16 steps | val loss | Δ val loss vs fp32 single |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        res = results.get(run.label)
        if res is None:
            continue
        if res.error:
            lines.append(
                f"| {run.layout.name} | {run.precision.name} | - | FAILED: {res.error.replace('|', '/')} | | | | | | |"
            )
            continue
        final = res.losses[max(res.losses)]
        path = f"{res.path}, router {res.router_dtype}" if res.router_dtype else res.path
        cells = [run.layout.name, run.precision.name, path, f"{final:.5f}"]
        ref = results.get(run.reference)
        if ref is not None and not ref.error:
            ref_final = ref.losses[max(ref.losses)]
            mabs, mrel = max_diff(res.losses, ref.losses)
            cells += [f"{final - ref_final:+.2e}", f"{fmt(mabs)} ({fmt(mrel)})"]
        else:
            cells += ["-", "-"]
        single = run.layout.reference
        same = results.get(f"{single} / {run.precision.name}")
        if run.layout.name == single:
            cells.append("(reference)")
        elif same is not None and not same.error:
            cells.append(fmt(max_diff(res.losses, same.losses)[0]))
        elif run.precision.needs_dp or run.precision.needs_cp:
            bf16 = results.get(f"{single} / bf16")
            cells.append(
                f"{fmt(max_diff(res.losses, bf16.losses)[0])} (vs single bf16)" if bf16 and not bf16.error else "-"
            )
        else:
            cells.append("-")
        cells.append(str(res.skipped_steps) if "fp16" in run.precision.name else "")
        cells.append(f"{res.val_loss:.5f}" if math.isfinite(res.val_loss) else "-")
        ref_val = ref.val_loss if ref is not None and not ref.error else math.nan
        cells.append(f"{res.val_loss - ref_val:+.2e}" if math.isfinite(res.val_loss - ref_val) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# What a run's training is judged by: every step's row of these, compared bit for bit.
DIFF_KEYS = ("step", "loss", "grad_norm", "loss_scale", "skipped_steps", "val_loss")


def run_names(out: Path) -> set[str]:
    """The runs an --out folder holds: its subfolders with a metrics.jsonl."""
    return {p.parent.name for p in out.glob("*/metrics.jsonl")}


def diff_outputs(before: Path, after: Path) -> list[str]:
    """Runs of two --out folders (e.g. the matrix before and after a refactor) whose metrics.jsonl
    rows differ in any DIFF_KEYS value, or that only one folder holds; [] when all are identical."""

    def rows(folder: Path) -> list[dict]:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k in DIFF_KEYS} for line in lines if line.strip()]

    names = {before: run_names(before), after: run_names(after)}
    problems = []
    for name in sorted(names[before] | names[after]):
        if name not in names[before] or name not in names[after]:
            problems.append(f"{name}: only in {before if name in names[before] else after}")
            continue
        a, b = rows(before / name), rows(after / name)
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(
                f"{name}: differs from row {i + 1} ({len(a)} vs {len(b)} rows): "
                f"{a[i] if i < len(a) else None} vs {b[i] if i < len(b) else None}"
            )
    return problems


def tail_mean(losses: dict[int, float], tail: int) -> float:
    """The mean loss of the last `tail` logged steps (one step's loss is mostly its batch's noise)."""
    last = [losses[s] for s in sorted(losses)[-tail:]]
    return sum(last) / len(last) if last else math.nan


def tail_gap_se(losses: dict[int, float], base: dict[int, float], tail: int) -> float:
    """The standard error of the mean of (loss - base loss) over the last `tail` common steps, as
    if the steps were independent: how much of a tail gap one batch's noise alone could make.

    Args:
        losses: the run's loss by step.
        base: the baseline's loss by step.
        tail: how many of the last common steps count.
    """
    steps = sorted(losses.keys() & base.keys())[-tail:]
    d = [losses[s] - base[s] for s in steps]
    if len(d) < 2:
        return math.nan
    mean = sum(d) / len(d)
    return math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))


def tail_table(results: dict[str, Result], runs: list[Run], tail: int, baseline: str) -> str:
    """Per run: the mean of its last `tail` losses, that minus the `baseline` run's (± the standard
    error of the per-step differences' mean) and the run's wall time.

    Args:
        results: each run's result by its label ('layout / precision').
        runs: the runs, in the table's order (a run without a result is left out).
        tail: how many of the last logged steps are averaged.
        baseline: the label of the run the others are compared with.
    """
    base = results.get(baseline)
    base_losses = base.losses if base is not None and not base.error else None
    base_mean = tail_mean(base_losses, tail) if base_losses is not None else math.nan
    lines = [
        f"| run | mean loss, last {tail} steps | minus {baseline}'s (± s.e.) | wall time |",
        "| --- | ---: | ---: | ---: |",
    ]
    for run in runs:
        res = results.get(run.label)
        if res is None or res.error:
            continue
        mean = tail_mean(res.losses, tail)
        se = (
            tail_gap_se(res.losses, base_losses, tail)
            if base_losses is not None and run.label != baseline
            else math.nan
        )
        gap = fmt(mean - base_mean, "+.4f") + (f" (± {se:.4f})" if math.isfinite(se) else "")
        lines.append(f"| {run.label} | {mean:.4f} | {gap} | {res.wall_s:.0f} s |")
    return "\n".join(lines)


def results_json(results: dict[str, Result], runs: list[Run], header: dict[str, object]) -> dict[str, object]:
    """Every run's per-step losses and the facts of its table row, for figures drawn without
    retraining (tools/numerics_figures.py); non-finite losses are null.

    Args:
        results: each run's result by its label ('layout / precision').
        runs: the runs, in the table's order (a run without a result is left out).
        header: the command, the settings and the notes, put before the runs.
    """
    rows = []
    for run in runs:
        res = results.get(run.label)
        if res is None:
            continue
        rows.append(
            {
                "label": run.label,
                "layout": run.layout.name,
                "precision": run.precision.name,
                "reference": run.reference,
                "path": res.path,
                "router_dtype": res.router_dtype,
                "error": res.error,
                "skipped_steps": res.skipped_steps,
                "val_loss": res.val_loss if math.isfinite(res.val_loss) else None,
                "losses": {str(s): (v if math.isfinite(v) else None) for s, v in sorted(res.losses.items())},
            }
        )
    return {**header, "runs": rows}


def diff_main(before: str, after: str) -> int:
    folders = (Path(before), Path(after))
    for out in folders:
        if not run_names(out):
            print(f"error: '{out}' holds no run (no */metrics.jsonl): give two --out folders", file=sys.stderr)
            return 2
    problems = diff_outputs(*folders)
    count = len(run_names(folders[0]) | run_names(folders[1]))
    print(
        "\n".join(problems)
        if problems
        else f"all {count} runs identical (every step's {', '.join(DIFF_KEYS[1:])}, bit for bit)"
    )
    return 1 if problems else 0
