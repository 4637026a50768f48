"""Compare the loss curves of two runs step by step.

Each side is either an existing run (its metrics.jsonl, or the dump folder holding it) or a run
this tool starts with torchrun (train.py with the given overrides, metrics logged every step):

    # two finished runs
    python -m torchtitan_amp.tools.loss_compare outputs/run_a outputs/run_b/metrics.jsonl

    # run both: 1 process vs FSDP over 2 processes, same global batch, same seed and data
    python -m torchtitan_amp.tools.loss_compare \\
        --common "--model.flavor debugmodel --training.seq_len 64 --training.steps 10 \\
                  --mixed_precision.enabled false" \\
        --run-a "--training.local_batch_size 4" --nproc-a 1 \\
        --run-b "--training.local_batch_size 2" --nproc-b 2 \\
        --rtol 1e-4

    # a finished baseline against a fresh run (a single override needs "=": --run-b=--compile.enable)
    python -m torchtitan_amp.tools.loss_compare outputs/baseline --run-b="--compile.enable" --common "..."

(or `torchtitan-amp-loss-compare`; `python scripts/loss_compare.py` from any folder, installed or
not). It prints one row per step (loss of A and B, absolute difference, and relative difference
|A - B| / |A|: A is the reference) and the maximum differences. For CI:

- `--assert-equal`: exit 1 unless both runs logged the same steps with bit-identical losses;
- `--rtol R` / `--atol A`: exit 1 if any step's relative / absolute difference exceeds R / A.

`--plot FILE.png` (or .svg, .pdf) also draws both curves and, below them, their difference B - A.

Exit codes: 0 the runs agree (or no check was asked for), 1 a check failed, 2 usage error, a run
that failed, or files without common steps. Same seed and data: both sides get the same
`--training.seed` unless their overrides differ; to compare data-parallel layouts with one
process, keep the global batch equal (a D-way data-parallel layout with local_batch_size B
matches one process with local_batch_size D x B).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan_amp.tools.plot import METRICS, PlotError, metrics_file, read_run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Started runs run from the checkout holding this package, so that relative paths in their
# overrides mean what they mean for train.py.
REPO = Path(__file__).resolve().parents[2]


class CompareError(Exception):
    """A problem with the inputs (exit code 2), as opposed to runs that disagree (exit code 1)."""


# ---------------------------------------------------------------------------------------------
# Reading


def metrics_path(path: str | Path) -> Path:
    try:
        return metrics_file(path)
    except PlotError as e:
        raise CompareError(str(e)) from None


def read_metric(path: str | Path, metric: str = "loss") -> dict[int, float]:
    """step -> value of `metric` (tools/plot.py's reader: a resumed run appends to the same file,
    the last entry of a step wins). Non-finite values (written as null) read as NaN."""
    try:
        run = read_run(path)
    except PlotError as e:
        raise CompareError(str(e)) from None
    lacking = [row["step"] for row in run.rows if metric not in row]
    if lacking:
        raise CompareError(f"{metrics_path(path)}: step {lacking[0]} has no '{metric}' field")
    out: dict[int, float] = {}
    for row in run.rows:
        step, value = row["step"], row[metric]
        assert step is not None  # read_run keys every row by int(step)
        out[int(step)] = math.nan if value is None else float(value)
    return out


# ---------------------------------------------------------------------------------------------
# Comparing


@dataclass
class Row:
    step: int
    a: float
    b: float

    @property
    def abs_diff(self) -> float:
        return abs(self.a - self.b)

    @property
    def rel_diff(self) -> float:
        """Relative to A, the reference side (to the larger value where A is 0)."""
        if self.a == self.b:  # also 0 == 0
            return 0.0
        return abs(self.a - self.b) / (abs(self.a) or abs(self.b))


@dataclass
class Comparison:
    rows: list[Row]
    only_a: list[int]
    only_b: list[int]

    @property
    def max_abs(self) -> float:
        return max((r.abs_diff for r in self.rows), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((r.rel_diff for r in self.rows), default=0.0)

    @property
    def bit_identical(self) -> bool:
        # NaN != NaN: a diverged run never counts as identical.
        return not self.only_a and not self.only_b and all(r.a == r.b for r in self.rows)

    def to_dict(self) -> dict:
        return {
            "steps": [r.step for r in self.rows],
            "a": [r.a for r in self.rows],
            "b": [r.b for r in self.rows],
            "max_abs_diff": self.max_abs,
            "max_rel_diff": self.max_rel,
            "bit_identical": self.bit_identical,
            "only_a": self.only_a,
            "only_b": self.only_b,
        }


def compare(a: dict[int, float], b: dict[int, float]) -> Comparison:
    common = sorted(a.keys() & b.keys())
    if not common:
        raise CompareError(f"the runs share no logged step (A: {sorted(a)[:5]}..., B: {sorted(b)[:5]}...)")
    return Comparison([Row(s, a[s], b[s]) for s in common], sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys()))


def format_table(c: Comparison, label_a: str = "A", label_b: str = "B", metric: str = "loss") -> str:
    """The step-by-step table of both runs' `metric`, their differences, and a summary line (max
    differences, bit identity, steps logged by one run only).

    Args:
        c: the two runs' comparison (compare's result).
        label_a: run A's name in the header.
        label_b: run B's name.
        metric: the metric compared (its name in the header).
    """
    lines = [
        f"{'step':>6}  {metric + ' ' + label_a:>14}  {metric + ' ' + label_b:>14}  {'abs diff':>10}  {'rel diff':>10}"
    ]
    for r in c.rows:
        lines.append(f"{r.step:>6}  {r.a:>14.7f}  {r.b:>14.7f}  {r.abs_diff:>10.3e}  {r.rel_diff:>10.3e}")
    lines.append(
        f"max abs diff {c.max_abs:.3e}, max rel diff {c.max_rel:.3e} over {len(c.rows)} common "
        f"steps; bit-identical: {'yes' if c.bit_identical else 'no'}"
    )
    if c.only_a or c.only_b:
        lines.append(f"steps logged by one run only: A {c.only_a or '-'}, B {c.only_b or '-'}")
    return "\n".join(lines)


def check(c: Comparison, *, assert_equal: bool, rtol: float | None, atol: float | None) -> list[str]:
    """The violated checks, as messages (empty: all passed).

    Args:
        c: the two runs' comparison (compare's result).
        assert_equal: require the runs bit-identical.
        rtol: the largest relative difference allowed; None: not checked.
        atol: the largest absolute difference allowed; None: not checked.
    """
    failures = []
    if assert_equal and not c.bit_identical:
        worst = max(c.rows, key=lambda r: (math.isnan(r.a) or math.isnan(r.b), r.abs_diff))
        failures.append(
            f"--assert-equal: losses differ (max abs diff {c.max_abs:.3e} at step {worst.step}"
            + (f"; steps only in one run: {c.only_a + c.only_b}" if c.only_a or c.only_b else "")
            + ")"
        )
    nan_steps = [r.step for r in c.rows if math.isnan(r.a) or math.isnan(r.b)]
    if (rtol is not None or atol is not None) and nan_steps:
        failures.append(f"non-finite loss at steps {nan_steps}")
    if rtol is not None and c.max_rel > rtol:
        worst = max(c.rows, key=lambda r: r.rel_diff)
        failures.append(f"--rtol {rtol:g}: max rel diff {c.max_rel:.3e} at step {worst.step} exceeds it")
    if atol is not None and c.max_abs > atol:
        worst = max(c.rows, key=lambda r: r.abs_diff)
        failures.append(f"--atol {atol:g}: max abs diff {c.max_abs:.3e} at step {worst.step} exceeds it")
    return failures


PLOT_FORMATS = (".png", ".svg", ".pdf")


def comparison_figure(c: Comparison, label_a: str, label_b: str, metric: str = "loss") -> Figure:
    """Both curves (top) and B - A (bottom) against the step: a matplotlib Figure.

    Args:
        c: the two runs' comparison (compare's result).
        label_a: run A's name in the legend.
        label_b: run B's name.
        metric: the metric compared (the axis label).
    """
    from matplotlib.figure import Figure  # only --plot needs matplotlib; no pyplot, no display

    steps = [r.step for r in c.rows]
    fig = Figure(figsize=(7, 5.5), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    top.plot(steps, [r.a for r in c.rows], label=f"A: {label_a}")
    top.plot(steps, [r.b for r in c.rows], "--", label=f"B: {label_b}")
    top.set_title(metric)
    top.legend(fontsize="small")
    bottom.plot(steps, [r.b - r.a for r in c.rows], color="C3")
    bottom.axhline(0.0, color="gray", linewidth=0.5)
    bottom.set_title(f"B - A (max |B - A| {c.max_abs:.3e}, max rel {c.max_rel:.3e})")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------
# Running


def train_command(nproc: int, dump_folder: Path, common: list[str], overrides: list[str]) -> list[str]:
    """The torchrun command line of one side: train.py on `nproc` CPU ranks, logging every step to
    `dump_folder`.

    Args:
        nproc: the CPU ranks.
        dump_folder: the run's job.dump_folder.
        common: config overrides both sides share.
        overrides: this side's own overrides (after the common ones, so they win).
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "train.py"),
        *common,
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(dump_folder),
        *overrides,
    ]


def run_side(name: str, nproc: int, common: list[str], overrides: list[str], out: Path, timeout: float) -> Path:
    """Train one side and return its dump folder (its output in `out`/NAME.log); CompareError if it
    fails or times out.

    Args:
        name: the side's name: its dump folder's and log's.
        nproc: the CPU ranks.
        common: config overrides both sides share.
        overrides: this side's own overrides.
        out: the folder holding both sides' dump folders and logs.
        timeout: seconds before the run is stopped.
    """
    dump = out / name
    if (dump / METRICS).exists():
        (dump / METRICS).unlink()  # metrics.jsonl appends: a stale file would mix two runs
    cmd = train_command(nproc, dump, common, overrides)
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CompareError(f"run {name} timed out after {timeout:.0f} s") from None
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise CompareError(f"run {name} failed with exit code {proc.returncode}; its output ends:\n{tail}")
    return dump


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 agree, 1 a check failed, 2 usage or run error.",
    )
    p.add_argument(
        "paths",
        nargs="*",
        help="metrics.jsonl files or dump folders: A then B (a side given by --run-a / --run-b takes no path)",
    )
    p.add_argument("--run-a", metavar="ARGS", help="run side A: train.py overrides, one quoted string")
    p.add_argument("--run-b", metavar="ARGS", help="run side B: train.py overrides, one quoted string")
    p.add_argument("--nproc-a", type=int, default=1, help="processes for --run-a (default 1)")
    p.add_argument("--nproc-b", type=int, default=1, help="processes for --run-b (default 1)")
    p.add_argument("--common", metavar="ARGS", default="", help="overrides given to both runs, before their own")
    p.add_argument("--out", default="outputs/loss_compare", help="dump folders of started runs (default %(default)s)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per started run")
    p.add_argument("--metric", default="loss", help="metrics.jsonl field to compare (default loss; e.g. grad_norm)")
    p.add_argument("--assert-equal", action="store_true", help="exit 1 unless the values are bit-identical")
    p.add_argument("--rtol", type=float, help="exit 1 if any step's relative difference exceeds this")
    p.add_argument("--atol", type=float, help="exit 1 if any step's absolute difference exceeds this")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help=f"also draw both curves and their difference ({', '.join(PLOT_FORMATS)}, by extension)",
    )
    args = p.parse_args(argv)
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_FORMATS:
        p.error(f"--plot {args.plot}: the file must end in {', '.join(PLOT_FORMATS)}")
    needed = (args.run_a is None) + (args.run_b is None)
    if len(args.paths) != needed:
        p.error(
            f"expected {needed} metrics path(s) for the side(s) not given by --run-a/--run-b, got {len(args.paths)}"
        )
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        paths = list(args.paths)
        sides = []
        common = shlex.split(args.common)
        out = Path(args.out)
        for name, run, nproc in (("a", args.run_a, args.nproc_a), ("b", args.run_b, args.nproc_b)):
            if run is None:
                sides.append(paths.pop(0))
            else:
                out.mkdir(parents=True, exist_ok=True)
                sides.append(run_side(name, nproc, common, shlex.split(run), out, args.timeout))
        a, b = (read_metric(s, args.metric) for s in sides)
        c = compare(a, b)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"A: {metrics_path(sides[0])}\nB: {metrics_path(sides[1])}")
    print(format_table(c, metric=args.metric))
    if args.json:
        Path(args.json).write_text(json.dumps(c.to_dict(), indent=1, allow_nan=True) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        comparison_figure(c, str(metrics_path(sides[0])), str(metrics_path(sides[1])), args.metric).savefig(args.plot)
    failures = check(c, assert_equal=args.assert_equal, rtol=args.rtol, atol=args.atol)
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    if not failures and (args.assert_equal or args.rtol is not None or args.atol is not None):
        print("PASS")
    return 1 if failures else 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
