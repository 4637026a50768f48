"""The project installs: pyproject.toml builds a wheel with the package and its commands, and
its dependencies are requirements.txt's."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.launch import REPO, run_command, run_python

pytestmark = pytest.mark.unit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", sorted(PYPROJECT["project"]["scripts"]))
def test_console_entry_points_name_callables(name: str) -> None:
    module, _, attr = PYPROJECT["project"]["scripts"][name].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_dependencies_are_the_requirements_file() -> None:
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}
    lines = [ln.split("#")[0].strip() for ln in (REPO / "requirements.txt").read_text().splitlines()]
    assert "torch>=2.11" in lines and "torchdata==0.11.0" in lines


def _can_build_wheels_offline() -> bool:
    """setuptools >= 70.1 builds wheels itself; an older one needs the `wheel` package (a venv
    made by Python 3.11's ensurepip has setuptools 65 and no wheel)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    version = tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())
    return version >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_wheels_offline(), reason="no setuptools >= 70.1 (or wheel) to build with offline")
def test_wheel_builds_with_the_package_and_its_commands(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    shutil.copytree(REPO / "torchtitan_amp", src / "torchtitan_amp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(REPO / name, src / name)
    result = run_command(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.describe()
    (wheel,) = tmp_path.glob("torchtitan_amp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("torchtitan_amp/main.py", "torchtitan_amp/checkpoint/manager.py", "torchtitan_amp/core/rules.py"):
        assert module in names
    assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "torchtitan-amp-train = torchtitan_amp.main:cli" in text
    requires = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: torchdata==0.11.0" in requires and "Requires-Dist: torch>=2.11" in requires


def test_python_dash_m_runs_the_trainer_entry() -> None:
    result = run_python("-m", "torchtitan_amp", "--help", timeout=60)
    assert result.returncode == 0 and "--mixed_precision.enabled" in result.stdout, result.describe()
