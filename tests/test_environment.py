"""An unusable Python is one line naming the fix: torch older than 2.11, or torchdata missing,
caught before any torchtitan_amp module imports them (train.py, the tools)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.launch import REPO, run_python
from torchtitan_amp.core import environment

pytestmark = pytest.mark.unit


def test_this_environment_is_fine() -> None:
    assert environment.problem() is None


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("2.13.0", True),
        ("2.13.0+cpu", True),
        ("2.14.0a0+git1", True),
        ("3.0", True),
        ("2.11.0+cu130", True),
        ("2.12.1", True),
        ("2.10.0", False),
        ("2.1.0+cu118", False),
    ],
)
def test_torch_version_floor(monkeypatch: pytest.MonkeyPatch, version: str, ok: bool) -> None:
    monkeypatch.setattr(environment, "_torch_version", lambda: version)
    message = environment.problem()
    assert (message is None) == ok, message
    if not ok:
        assert message.startswith(f"torch {version} is older than the supported 2.11")
        assert message.endswith("install it with: pip install torch==2.13.0 -r requirements.txt")


def test_no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "_torch_version", lambda: None)
    assert environment.problem().startswith("torch is not installed in ")


@pytest.mark.parametrize(
    ("capability", "preset", "expected_suffix"),
    [("avx2", None, "_avx2"), ("AVX512", None, "_avx512"), (None, None, None), ("avx2", "/my/cache", None)],
)
def test_emulated_capabilities_get_their_own_compile_cache(
    monkeypatch: pytest.MonkeyPatch, capability: str | None, preset: str | None, expected_suffix: str | None
) -> None:
    for name, value in (("ATEN_CPU_CAPABILITY", capability), ("TORCHINDUCTOR_CACHE_DIR", preset)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    environment.separate_inductor_cache()
    got = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if expected_suffix is None:
        assert got == preset
    else:
        assert got is not None and Path(got).name.startswith("torchinductor_") and got.endswith(expected_suffix)


def _fake_site(tmp_path: Path, torch_version: str | None = None, break_torchdata: bool = False) -> dict[str, str]:
    """A folder put first on PYTHONPATH: fake torch metadata, or a torchdata that fails to import."""
    if torch_version:
        meta = tmp_path / f"torch-{torch_version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    if break_torchdata:
        (tmp_path / "torchdata").mkdir()
        (tmp_path / "torchdata" / "__init__.py").write_text("raise ImportError('No module named torchdata')\n")
    return {"PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("old_torch", "error: torch 2.1.0 is older than the supported 2.11"),
        (
            "no_torchdata",
            "error: torchdata is missing or broken (No module named torchdata); install it with: "
            "pip install torchdata==0.11.0",
        ),
    ],
)
def test_train_py_says_what_to_install_in_one_line(tmp_path: Path, kind: str, expected: str) -> None:
    env = _fake_site(
        tmp_path, torch_version="2.1.0" if kind == "old_torch" else None, break_torchdata=kind == "no_torchdata"
    )
    result = run_python(
        "train.py", "--training.steps", "1", "--job.dump_folder", str(tmp_path / "out"), env=env, timeout=120
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected), result.describe()
    assert not (tmp_path / "out").exists()  # nothing ran


def test_checkpoint_cli_checks_the_environment_before_importing_torch(tmp_path: Path) -> None:
    env = _fake_site(tmp_path, torch_version="2.1.0")
    env["PYTHONPATH"] += os.pathsep + str(REPO)
    result = run_python("-m", "torchtitan_amp.checkpoint", "list", str(tmp_path), env=env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.describe()
    assert lines[0].startswith("error: torch 2.1.0 is older than the supported 2.11")
