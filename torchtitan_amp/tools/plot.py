"""Draw runs' metrics: loss (and validation loss), gradient norm, learning rate, throughput and MFU
against steps or tokens, one line per run, from each run's metrics.jsonl.

    python -m torchtitan_amp.tools.plot outputs/debug_model -o loss.png
    python -m torchtitan_amp.tools.plot outputs/run_a outputs/run_b/metrics.jsonl --x tokens -o runs.svg

(or `torchtitan-amp-plot`). RUN is a dump folder or its metrics.jsonl; the legend names each run
by its folder. Only the panels whose metrics some run logged are drawn. A resumed run logs some
steps twice: the last entry of a step wins, as in tools/loss_compare.py. The format follows the
extension of -o (.png, .svg, .pdf). Exit 0, or 2 with one `error:` line for a missing or empty run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS = "metrics.jsonl"
FORMATS = (".png", ".svg", ".pdf")
# The x axes: metrics.jsonl's step, or the tokens trained on up to it (all ranks).
X_KEYS = {"step": "step", "tokens": "tokens_seen"}
DPI = 100


class PlotError(Exception):
    """Bad input: a missing run, a file that is not metrics, an unknown output format."""


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # metrics.jsonl fields drawn in it; the first solid, the others dashed
    log_y: bool = False


PANELS = (
    Panel("loss", ("loss", "val_loss")),
    Panel("grad norm", ("grad_norm",), log_y=True),
    Panel("learning rate", ("lr",)),
    Panel("throughput (tokens/s per rank)", ("tps",)),
    Panel("MFU (%)", ("mfu",)),
)


@dataclass
class Run:
    name: str
    rows: list[dict[str, float | None]]  # one per logged step, ascending, the last entry per step


def metrics_file(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / METRICS
    if not p.is_file():
        raise PlotError(f"no metrics file at '{path}' (expected a dump folder holding {METRICS}, or the file)")
    return p


def read_run(path: str | Path) -> Run:
    """A run's logged steps, named after its folder."""
    p = metrics_file(path)
    by_step: dict[int, dict] = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{p}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise PlotError(f"{p}:{n}: not a metrics row (no 'step')")
        by_step[int(row["step"])] = row
    if not by_step:
        raise PlotError(f"{p} holds no logged steps")
    return Run(p.resolve().parent.name, [by_step[s] for s in sorted(by_step)])


def series(run: Run, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x values, `key` values) over the steps that logged `key`; a non-finite value (written as
    null) is NaN, which draws as a gap.

    Args:
        run: the run read (read_run).
        key: the metric drawn.
        x: the x axis: "step", or another of X_KEYS (e.g. "tokens").
    """
    x_key = X_KEYS[x]
    xs, ys = [], []
    for row in run.rows:
        if key not in row:
            continue
        x_value, value = row.get(x_key), row[key]
        if x_value is None:
            raise PlotError(
                f"run '{run.name}' step {row['step']} has no '{x_key}' (written by runs since "
                f"tokens were logged); draw it with --x step"
            )
        xs.append(float(x_value))
        ys.append(math.nan if value is None else float(value))
    return xs, ys


def panels_for(runs: list[Run]) -> list[Panel]:
    """The panels whose first metric some run logged."""
    return [p for p in PANELS if any(p.keys[0] in row for run in runs for row in run.rows)]


def unique_names(paths: list[str], runs: list[Run]) -> list[Run]:
    """Runs named by folder; where two folders share a name, by the path given instead."""
    names = [r.name for r in runs]
    return [Run(r.name if names.count(r.name) == 1 else str(Path(p)), r.rows) for p, r in zip(paths, runs)]


def build_figure(runs: list[Run], x: str = "step") -> Figure:
    """One panel per metric present, one line per run (and a dashed one for its validation loss)."""
    from matplotlib.figure import Figure

    panels = panels_for(runs)
    if not panels:
        raise PlotError("none of the runs logged loss, grad_norm, lr, tps or mfu")
    cols = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(5.5 * cols, 3.0 * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, panel in zip(axes, panels):
        for run, color in zip(runs, colors):
            for i, key in enumerate(panel.keys):
                xs, ys = series(run, key, x)
                if xs:
                    label = run.name if i == 0 else f"{run.name} ({key})"
                    ax.plot(
                        xs,
                        ys,
                        color=color,
                        linestyle="-" if i == 0 else "--",
                        marker="o" if len(xs) == 1 else None,
                        label=label,
                    )
        ax.set_title(panel.title)
        ax.set_xlabel(x)
        if panel.log_y:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.remove()
    return fig


def output_path(output: str | Path) -> Path:
    out = Path(output)
    if out.suffix.lower() not in FORMATS:
        raise PlotError(f"-o {output}: the file must end in {', '.join(FORMATS)}")
    return out


def save(fig: Figure, output: str | Path) -> Path:
    """Write `fig` in the format of the file's extension."""
    out = output_path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="dump folders (or their metrics.jsonl)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the picture: .png, .svg or .pdf")
    p.add_argument("--x", choices=tuple(X_KEYS), default="step", help="x axis (default %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        output_path(a.output)  # a bad name fails before any reading
        runs = unique_names(a.runs, [read_run(r) for r in a.runs])
        out = save(build_figure(runs, a.x), a.output)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
