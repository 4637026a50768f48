"""The figures of docs/numerics.md, drawn from the numbers the numerics tools saved, no training:

    python -m torchtitan_amp.tools.numerics_figures docs/img

reads, in that folder, numerics_matrix.json (`numerics_matrix --json`), optimizer_precision.json
(`python -m benchmarks.optimizer_precision --json`) and blockscaled_curves.json (`numerics_matrix
--preset blockscaled --json`), whichever exist, and writes next to them numerics_matrix.png (max
|loss - fp32 single| per layout x precision), numerics_matrix_curves.png (each run's loss minus its
fp32 single-process reference, per step, one panel per precision), optimizer_precision.png and
blockscaled_curves.png (the loss curves and their running-mean difference from fp32's / bf16's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan_amp.tools.plot import DPI

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MATRIX_JSON = "numerics_matrix.json"
OPTIMIZER_JSON = "optimizer_precision.json"
BLOCKSCALED_JSON = "blockscaled_curves.json"
BLOCKSCALED_REFERENCE = "single / bf16"
SMOOTH = 25  # steps in the optimizer figure's running mean: per-step noise is ~0.02, the bias sought ~0.01


class FigureError(Exception):
    pass


def losses_by_step(run: dict[str, Any]) -> dict[int, float]:
    return {int(s): math.nan if v is None else float(v) for s, v in run["losses"].items()}


def deltas(run: dict[str, Any], ref: dict[str, Any]) -> tuple[list[int], list[float]]:
    """(steps, loss - reference loss) over the steps both logged."""
    a, b = losses_by_step(run), losses_by_step(ref)
    steps = sorted(a.keys() & b.keys())
    return steps, [a[s] - b[s] for s in steps]


def matrix_cells(data: dict[str, Any]) -> tuple[list[str], list[str], dict[tuple[str, str], float | None]]:
    """Layouts (rows), precisions (columns) in the order run, and each finished run's max |loss -
    reference| over the steps (None: the run failed; absent: not run)."""
    runs = {r["label"]: r for r in data["runs"]}
    layouts = list(dict.fromkeys(r["layout"] for r in data["runs"]))
    precisions = list(dict.fromkeys(r["precision"] for r in data["runs"]))
    cells: dict[tuple[str, str], float | None] = {}
    for r in data["runs"]:
        ref = runs.get(r["reference"])
        if r["error"] or ref is None or ref["error"]:
            cells[r["layout"], r["precision"]] = None
            continue
        diffs = [abs(d) for d in deltas(r, ref)[1]]
        cells[r["layout"], r["precision"]] = math.nan if any(map(math.isnan, diffs)) else max(diffs, default=0.0)
    return layouts, precisions, cells


def matrix_figure(data: dict[str, Any]) -> Figure:
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    layouts, precisions, cells = matrix_cells(data)
    grid = np.full((len(layouts), len(precisions)), np.nan)
    for (lay, prec), v in cells.items():
        if v is not None and v > 0:
            grid[layouts.index(lay), precisions.index(prec)] = v
    fig = Figure(figsize=(1.3 * len(precisions) + 3, 0.38 * len(layouts) + 2.2), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(grid), norm=LogNorm(vmin=1e-7, vmax=3e-2), cmap="viridis", aspect="auto")
    for (lay, prec), v in cells.items():
        text = "failed" if v is None else "ref" if v == 0 else f"{v:.0e}"
        ax.text(
            precisions.index(prec),
            layouts.index(lay),
            text,
            ha="center",
            va="center",
            fontsize=7,
            color="white" if v is not None and 0 < v < 3e-4 else "black",
        )
    ax.set_xticks(range(len(precisions)), [p.replace(" + ", "\n+ ") for p in precisions], fontsize=8)
    ax.set_yticks(range(len(layouts)), layouts, fontsize=8)
    ax.set_title("max |loss - fp32 single process| over the steps (blank: not run)", fontsize=10)
    fig.colorbar(image, ax=ax, label="max |Δ loss|")
    return fig


def curves_figure(data: dict[str, Any]) -> Figure:
    """One panel per precision: for each layout, the largest |loss - reference loss| up to each
    step (the per-step difference changes sign from step to step; its running maximum shows when
    a run parts from fp32 and ends at the heatmap's value). Log scale: fp32 rows sit near 1e-6,
    mixed precision near 1e-3; a run equal to its reference so far draws nothing yet."""
    from matplotlib.figure import Figure

    runs = {r["label"]: r for r in data["runs"]}
    precisions = list(dict.fromkeys(r["precision"] for r in data["runs"]))
    cols = 2
    rows = math.ceil(len(precisions) / cols)
    fig = Figure(figsize=(10, 2.5 * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True).flatten()
    for ax, prec in zip(axes, precisions):
        drawn = 0
        for i, r in enumerate(r for r in data["runs"] if r["precision"] == prec):
            ref = runs.get(r["reference"])
            if r["error"] or ref is None or ref["error"] or r["label"] == r["reference"]:
                continue
            steps, ds = deltas(r, ref)
            ax.plot(
                steps,
                list(accumulate((abs(d) for d in ds), max)),
                label=r["layout"],
                color=f"C{i % 10}",
                linestyle="-" if i < 10 else "--",
            )
            drawn += 1
        ax.set_yscale("log")
        ax.set_ylim(1e-8, 5e-2)
        ax.set_title(f"{prec}: max |loss - fp32 single| so far", fontsize=10)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=6, ncol=2)
    for ax in axes[len(precisions) :]:
        ax.remove()
    for ax in axes[: len(precisions)][-cols:]:
        ax.set_xlabel("step")
    return fig


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def optimizer_figure(data: dict[str, Any]) -> Figure:
    from matplotlib.figure import Figure

    curves = data["curves"]
    if "fp32" not in curves:
        raise FigureError(f"{OPTIMIZER_JSON} has no 'fp32' curve to compare with")
    ref = curves["fp32"]["losses"]
    fig = Figure(figsize=(9, 7), dpi=DPI, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for i, (name, c) in enumerate(curves.items()):
        steps = list(range(1, len(c["losses"]) + 1))
        label = f"{name} ({c['bytes_per_param']} B/param)"
        top.plot(steps, c["losses"], color=f"C{i}", linewidth=0.8, label=label)
        diff = [x - y for x, y in zip(c["losses"], ref)]
        bottom.plot(steps[: len(diff)], running_mean(diff, SMOOTH), color=f"C{i}", label=name)
    top.set_title("loss")
    top.set_ylim(top=min(6.5, max(max(c["losses"][:1]) for c in curves.values()) + 0.2))
    top.legend(fontsize=8)
    bottom.set_title(f"loss - fp32's loss, running mean over {SMOOTH} steps")
    bottom.axhline(0.0, color="gray", linewidth=0.5)
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    return fig


def blockscaled_figure(data: dict[str, Any]) -> Figure:
    """The single-process runs of a numerics_matrix JSON against its bf16 run: the loss (running
    mean over SMOOTH steps: one batch's loss is noise) and loss - bf16's loss (the same mean)."""
    from matplotlib.figure import Figure

    runs = [r for r in data["runs"] if r["layout"] == "single" and not r["error"]]
    ref = next((r for r in runs if r["label"] == BLOCKSCALED_REFERENCE), None)
    if ref is None:
        raise FigureError(f"{BLOCKSCALED_JSON} has no '{BLOCKSCALED_REFERENCE}' run to compare with")
    fig = Figure(figsize=(9, 7), dpi=DPI, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for i, r in enumerate(runs):
        losses = losses_by_step(r)
        steps = sorted(losses)
        top.plot(
            steps, running_mean([losses[s] for s in steps], SMOOTH), color=f"C{i}", linewidth=0.9, label=r["precision"]
        )
        d_steps, ds = deltas(r, ref)
        bottom.plot(d_steps, running_mean(ds, SMOOTH), color=f"C{i}", label=r["precision"])
    top.set_title(f"loss, running mean over {SMOOTH} steps")
    top.legend(fontsize=8)
    bottom.set_title(f"loss - bf16's loss, running mean over {SMOOTH} steps")
    bottom.axhline(0.0, color="gray", linewidth=0.5)
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    return fig


def write_figures(folder: Path) -> list[Path]:
    """Every figure whose data `folder` holds; the paths written."""
    written = []
    matrix, optimizer, blockscaled = folder / MATRIX_JSON, folder / OPTIMIZER_JSON, folder / BLOCKSCALED_JSON
    if not any(p.is_file() for p in (matrix, optimizer, blockscaled)):
        raise FigureError(
            f"'{folder}' holds none of {MATRIX_JSON}, {OPTIMIZER_JSON}, {BLOCKSCALED_JSON} (write "
            "them with numerics_matrix --json FILE, benchmarks.optimizer_precision --json FILE, "
            "numerics_matrix --preset blockscaled --json FILE)"
        )
    jobs = []
    if matrix.is_file():
        data = _read(matrix)
        jobs += [("numerics_matrix.png", matrix_figure, data), ("numerics_matrix_curves.png", curves_figure, data)]
    if optimizer.is_file():
        jobs.append(("optimizer_precision.png", optimizer_figure, _read(optimizer)))
    if blockscaled.is_file():
        jobs.append(("blockscaled_curves.png", blockscaled_figure, _read(blockscaled)))
    for name, draw, data in jobs:
        draw(data).savefig(folder / name, dpi=DPI)
        written.append(folder / name)
    return written


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FigureError(f"{path}: not JSON ({e})") from None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "folder", nargs="?", default="docs/img", help="where the JSON is and the PNGs go (default %(default)s)"
    )
    a = p.parse_args(argv)
    try:
        for path in write_figures(Path(a.folder)):
            print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    except (FigureError, KeyError) as e:
        print(f"error: {e if isinstance(e, FigureError) else f'missing field {e} in the JSON'}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
