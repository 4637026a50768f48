"""numerics_matrix --diff: the programmatic before/after check of a refactor, in process."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torchtitan_amp.tools import numerics_matrix, numerics_report


def _write(out: Path, run: str, rows: list[dict]) -> None:
    (out / run).mkdir(parents=True, exist_ok=True)
    (out / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [
    {"step": 1, "loss": 5.5, "grad_norm": 2.0, "tps": 100.0},
    {"step": 2, "loss": 5.25, "grad_norm": 1.5, "tps": 90.0},
]


def test_identical_runs_pass_whatever_their_speed(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    _write(tmp_path / "a", "single_fp32", ROWS)
    _write(tmp_path / "b", "single_fp32", [{**r, "tps": 1.0} for r in ROWS])
    assert numerics_matrix.main(["--diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "all 1 runs identical" in capsys.readouterr().out


def test_one_ulp_or_a_missing_run_is_reported(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    _write(tmp_path / "a", "single_fp32", ROWS)
    _write(tmp_path / "a", "ddp_2_fp32", ROWS)
    _write(tmp_path / "b", "single_fp32", [ROWS[0], {**ROWS[1], "loss": 5.250000000000001}])
    assert numerics_matrix.main(["--diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "single_fp32: differs from row 2" in out and f"ddp_2_fp32: only in {tmp_path / 'a'}" in out


def test_a_folder_without_runs_is_a_usage_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    _write(tmp_path / "a", "single_fp32", ROWS)
    (tmp_path / "empty").mkdir()
    assert numerics_matrix.main(["--diff", str(tmp_path / "a"), str(tmp_path / "empty")]) == 2
    assert "holds no run" in capsys.readouterr().err


def test_reuse_keeps_runs_finished_with_the_same_arguments(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """--reuse: a run folder finished with exactly this run's training arguments is read, not
    retrained (all reused here: no launch); other arguments or an older done.json are not reused."""
    a = numerics_matrix.parse_args(["--steps", "2", "--out", str(tmp_path)])
    run = next(r for r in numerics_matrix.select_runs(1, None)[0] if r.label == "single / fp32")
    _write(tmp_path, run.key, ROWS)
    done = tmp_path / run.key / "done.json"
    done.write_text(json.dumps({"wall_s": 1.5, "args": numerics_matrix.train_args(run, a)}))
    assert numerics_matrix.reusable(run, a, tmp_path)
    assert not numerics_matrix.reusable(run, numerics_matrix.parse_args(["--steps", "3"]), tmp_path)
    argv = ["--only", "^single / fp32$", "--steps", "2", "--out", str(tmp_path), "--reuse", "--tail", "2"]
    assert numerics_matrix.main(argv) == 0
    out = capsys.readouterr().out
    assert "single / fp32: reused from" in out and "launching" not in out
    assert "| single | fp32 |  | 5.25000 |" in out and "| single / fp32 | 5.3750 |" in out
    # The tail gap's standard error: differences 0.1 and 0.3 -> sd 0.1414, / sqrt(2) = 0.1.
    assert math.isclose(numerics_report.tail_gap_se({1: 5.1, 2: 5.3}, {1: 5.0, 2: 5.0}, 2), 0.1, rel_tol=1e-9)
    done.write_text(json.dumps({"wall_s": 1.5}))
    assert not numerics_matrix.reusable(run, a, tmp_path)
