"""Pictures of runs: tools/plot.py, tools/loss_compare.py --plot and the figures of
docs/numerics.md (tools/numerics_figures.py). In-process, from small synthetic metrics; each PNG
is decoded and checked by its pixels (size, non-blank, which panel holds which run's colour), the
figure's panels by their titles."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg
from matplotlib.colors import to_rgb

from tests.support.launch import REPO
from torchtitan_amp.tools import loss_compare as lc
from torchtitan_amp.tools import numerics_figures as nf
from torchtitan_amp.tools import plot

C0, C1, C3 = (to_rgb(f"C{i}") for i in (0, 1, 3))  # run A, run B, loss_compare's difference
DOCS_IMG = REPO / "docs" / "img"


def _write_run(path: Path, steps: int, *, loss0: float, val_every: int = 0, mfu: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "loss": loss0 / s**0.5,
            "grad_norm": 2.0 / s,
            "lr": 1e-3 * min(s, 3) / 3,
            "tps": 1000.0 + s,
            "tokens_seen": 256.0 * s,
        }
        if mfu:
            row["mfu"] = 1.5
        if val_every and s % val_every == 0:
            row["val_loss"] = loss0 / s**0.5 + 0.1
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pixels(png: Path) -> np.ndarray:
    img = mpimg.imread(png)
    assert img.ndim == 3 and img.shape[2] in (3, 4), img.shape
    return img[..., :3]


def _count(img: np.ndarray, rgb: tuple[float, float, float]) -> int:
    """Pixels of exactly this colour (anti-aliased edges excluded: within 1/255 on each channel)."""
    return int((np.abs(img - np.array(rgb)) < 1.5 / 255).all(axis=-1).sum())


def _cells(img: np.ndarray, rows: int, cols: int) -> list[list[np.ndarray]]:
    h, w = img.shape[0] // rows, img.shape[1] // cols
    return [[img[r * h : (r + 1) * h, c * w : (c + 1) * w] for c in range(cols)] for r in range(rows)]


# ---------------------------------------------------------------------------------------------
# plot: metrics rows -> series -> panels -> PNG


def test_series_takes_the_last_entry_per_step_and_gaps_for_null(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "a", 4, loss0=4.0, val_every=2)
    with (run / "metrics.jsonl").open("a") as fh:  # a resumed run logs steps 3 and 4 again
        fh.write(json.dumps({"step": 3, "loss": None, "tokens_seen": 768.0}) + "\n")
        fh.write(json.dumps({"step": 4, "loss": 9.0, "tokens_seen": 1024.0}) + "\n")
    r = plot.read_run(run)
    assert r.name == "a" and [row["step"] for row in r.rows] == [1, 2, 3, 4]
    xs, ys = plot.series(r, "loss")
    assert xs == [1.0, 2.0, 3.0, 4.0] and ys[:2] == [4.0, 4.0 / 2**0.5] and math.isnan(ys[2]) and ys[3] == 9.0
    assert plot.series(r, "val_loss") == ([2.0], [4.0 / 2**0.5 + 0.1])  # step 4's val was replaced
    assert plot.series(r, "loss", x="tokens")[0] == [256.0, 512.0, 768.0, 1024.0]
    assert [p.title for p in plot.panels_for([r])] == [
        "loss",
        "grad norm",
        "learning rate",
        "throughput (tokens/s per rank)",
        "MFU (%)",
    ]


def test_plot_two_runs_draws_every_panel_with_both_runs(tmp_path: Path) -> None:
    a = _write_run(tmp_path / "run_a", 20, loss0=5.0, val_every=5)
    b = _write_run(tmp_path / "run_b", 12, loss0=4.0)
    out = tmp_path / "runs.png"
    assert plot.main([str(a), str(b / "metrics.jsonl"), "-o", str(out)]) == 0

    runs = [plot.read_run(a), plot.read_run(b)]
    fig = plot.build_figure(runs)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "grad norm", "learning rate", "throughput (tokens/s per rank)", "MFU (%)"]
    # loss: both runs plus run_a's validation loss; every other panel one line per run.
    assert [[ln.get_label() for ln in ax.lines] for ax in fig.axes][:2] == [
        ["run_a", "run_a (val_loss)", "run_b"],
        ["run_a", "run_b"],
    ]

    img = _pixels(out)
    assert img.shape[:2] == (900, 1100)  # 3 rows x 3 in, 2 columns x 5.5 in, at 100 dpi
    assert (img < 0.9).any(axis=-1).mean() > 0.02  # drawn on, not a blank canvas
    # 5 panels on a 3 x 2 grid: each of the first five cells holds both runs' colours, the sixth
    # (removed) is white.
    cells = [c for row in _cells(img, 3, 2) for c in row]
    for i, cell in enumerate(cells[:5]):
        assert _count(cell, C0) > 50 and _count(cell, C1) > 50, (titles[i], _count(cell, C0), _count(cell, C1))
    assert (cells[5][20:-20, 20:-20] > 0.99).all()  # inside its edges (the neighbours' spines)


def test_plot_draws_only_the_panels_logged_against_tokens_as_svg(tmp_path: Path) -> None:
    a = _write_run(tmp_path / "a", 5, loss0=5.0, mfu=False)
    fig = plot.build_figure([plot.read_run(a)], x="tokens")
    assert [ax.get_title() for ax in fig.axes] == [
        "loss",
        "grad norm",
        "learning rate",
        "throughput (tokens/s per rank)",
    ]
    assert fig.axes[0].lines[0].get_xdata().tolist() == [256.0, 512.0, 768.0, 1024.0, 1280.0]
    out = tmp_path / "a.svg"
    assert plot.main([str(a), "--x", "tokens", "-o", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<?xml") and "<svg" in out.read_text()[:2000]


def test_plot_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write_run(tmp_path / "good", 3, loss0=5.0)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("\n")
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")  # before tokens_seen
    cases = {
        "missing": ([str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")], "no metrics file at"),
        "empty": ([str(empty), "-o", str(tmp_path / "x.png")], "holds no logged steps"),
        "format": ([str(good), "-o", str(tmp_path / "x.jpg")], "must end in .png, .svg, .pdf"),
        "tokens": ([str(old), "--x", "tokens", "-o", str(tmp_path / "x.png")], "has no 'tokens_seen'"),
    }
    for name, (argv, message) in cases.items():
        assert plot.main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (name, err)
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.jpg").exists()


# ---------------------------------------------------------------------------------------------
# loss_compare --plot


def test_loss_compare_plot_draws_both_curves_and_their_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _write_run(tmp_path / "a", 30, loss0=5.0)
    b = tmp_path / "b.jsonl"
    # B is A plus 0.01 * step / 30: the difference panel ends 0.01 above its start.
    b.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s**0.5 + 0.01 * s / 30}) + "\n" for s in range(1, 31)))
    out = tmp_path / "cmp.png"
    assert lc.main([str(a), str(b), "--plot", str(out)]) == 0
    assert "max abs diff 1.000e-02" in capsys.readouterr().out
    img = _pixels(out)
    assert img.shape[:2] == (550, 700)
    # Top two thirds: the two curves (A solid C0, B dashed C1); bottom third: the difference (C3).
    top, bottom = img[:340], img[370:]
    assert _count(top, C0) > 100 and _count(top, C1) > 50 and _count(top, C3) == 0
    assert _count(bottom, C3) > 100 and _count(bottom, C0) == _count(bottom, C1) == 0
    fig = lc.comparison_figure(lc.compare(lc.read_metric(a), lc.read_metric(b)), "a", "b")
    assert np.allclose(fig.axes[1].lines[0].get_ydata(), [0.01 * s / 30 for s in range(1, 31)], rtol=0, atol=1e-12)
    # A bad extension is a usage error before anything is read.
    with pytest.raises(SystemExit) as e:
        lc.main([str(a), str(b), "--plot", str(tmp_path / "cmp.txt")])
    assert e.value.code == 2 and "--plot" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# numerics figures


def _matrix_json() -> dict:
    def run(layout: str, precision: str, offset: float, error: str = "") -> dict:
        return {
            "label": f"{layout} / {precision}",
            "layout": layout,
            "precision": precision,
            "reference": "single / fp32",
            "path": "full",
            "router_dtype": "",
            "error": error,
            "skipped_steps": 0,
            "val_loss": None,
            "losses": {} if error else {str(s): 4.0 - 0.1 * s + offset * s for s in range(1, 6)},
        }

    return {
        "command": "c",
        "settings": "s",
        "steps": 5,
        "notes": [],
        "runs": [
            run("single", "fp32", 0.0),
            run("single", "bf16", 1e-3),
            run("DDP 2", "fp32", 2e-7),
            run("DDP 2", "bf16", -4e-4),
            run("TP 2", "fp32", 0.0, error="boom"),
        ],
    }


def test_matrix_cells_are_max_deviation_from_the_reference() -> None:
    layouts, precisions, cells = nf.matrix_cells(_matrix_json())
    assert layouts == ["single", "DDP 2", "TP 2"] and precisions == ["fp32", "bf16"]
    # Offsets grow by `offset` per step: the largest deviation is at step 5.
    expected = {
        ("single", "fp32"): 0.0,
        ("single", "bf16"): 5e-3,
        ("DDP 2", "fp32"): 1e-6,
        ("DDP 2", "bf16"): 2e-3,
        ("TP 2", "fp32"): None,
    }
    assert cells.keys() == expected.keys()
    for key, value in expected.items():
        assert cells[key] == value if value is None else math.isclose(cells[key], value, rel_tol=1e-9, abs_tol=1e-15), (
            key
        )
    assert nf.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_numerics_figures_from_json_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / nf.MATRIX_JSON).write_text(json.dumps(_matrix_json()))
    curve = [5.0 - 0.01 * s for s in range(60)]
    (tmp_path / nf.OPTIMIZER_JSON).write_text(
        json.dumps(
            {
                "curves": {
                    "fp32": {"losses": curve, "bytes_per_param": 16},
                    "pure bf16": {"losses": [x + 0.02 for x in curve], "bytes_per_param": 8},
                }
            }
        )
    )
    assert nf.main([str(tmp_path)]) == 0
    for name in ("numerics_matrix.png", "numerics_matrix_curves.png", "optimizer_precision.png"):
        img = _pixels(tmp_path / name)
        assert (img < 0.9).any(axis=-1).mean() > 0.01, name
    curves = nf.curves_figure(_matrix_json())
    assert [ax.get_title() for ax in curves.axes] == [
        "fp32: max |loss - fp32 single| so far",
        "bf16: max |loss - fp32 single| so far",
    ]
    # The reference itself and the failed run draw no line; DDP 2 / bf16 ends 4e-4 x 5 steps away.
    assert [ln.get_label() for ln in curves.axes[0].lines] == ["DDP 2"]
    assert np.allclose(curves.axes[1].lines[1].get_ydata(), [4e-4 * s for s in range(1, 6)], rtol=1e-9)
    opt = nf.optimizer_figure(json.loads((tmp_path / nf.OPTIMIZER_JSON).read_text()))
    # The difference panel: fp32 at 0, pure bf16 at +0.02 throughout.
    diff = opt.axes[1].lines[1].get_ydata()
    assert np.allclose(diff, 0.02, atol=1e-12) and not np.any(opt.axes[1].lines[0].get_ydata())
    assert nf.main([str(tmp_path / "nothing")]) == 2 and capsys.readouterr().err.startswith("error: ")


def test_blockscaled_figure_compares_single_runs_with_bf16() -> None:
    fig = nf.blockscaled_figure(_matrix_json())
    top, bottom = fig.axes
    # Single runs only (fp32, bf16); fp32 - bf16 = -1e-3 x step, averaged from the start (5 < SMOOTH).
    assert [ln.get_label() for ln in bottom.lines[:-1]] == ["fp32", "bf16"]  # the last: the zero line
    assert np.allclose(bottom.lines[0].get_ydata(), [-1e-3 * (s + 1) / 2 for s in range(1, 6)], rtol=1e-9)
    assert not np.any(bottom.lines[1].get_ydata())
    data = _matrix_json()
    data["runs"] = [r for r in data["runs"] if r["label"] != "single / bf16"]
    with pytest.raises(nf.FigureError, match="no 'single / bf16' run"):
        nf.blockscaled_figure(data)


def test_docs_figures_are_checked_in_small_and_regenerate_from_their_json(tmp_path: Path) -> None:
    """docs/numerics.md shows figures drawn by one command from JSON kept beside them: the
    command redraws each at the same size, and each is under 150 KB."""
    names = ["numerics_matrix.png", "numerics_matrix_curves.png", "optimizer_precision.png", "blockscaled_curves.png"]
    for name in (nf.MATRIX_JSON, nf.OPTIMIZER_JSON, nf.BLOCKSCALED_JSON):
        (tmp_path / name).write_bytes((DOCS_IMG / name).read_bytes())
    assert nf.main([str(tmp_path)]) == 0
    docs = (REPO / "docs" / "numerics.md").read_text()
    assert "python -m torchtitan_amp.tools.numerics_figures docs/img" in docs
    for name in [*names, "debug_loss.png"]:
        assert (DOCS_IMG / name).stat().st_size < 150_000, name
    for name in names:
        assert re.search(rf"!\[[^\]]*\]\(img/{re.escape(name)}\)", docs), name
        assert _pixels(tmp_path / name).shape == _pixels(DOCS_IMG / name).shape, name
