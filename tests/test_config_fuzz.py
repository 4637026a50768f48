"""Fuzz the config loader and CLI: no input crashes it; every rejection is one ConfigError line,
and train.py turns it into exit code 2 with one line on stderr."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import train
from torchtitan_amp import config as cfg
from torchtitan_amp.config.fields import _field_types

SECTIONS = cfg.section_names()
KEYS = [f"{s}.{k}" for s in SECTIONS for k in _field_types(s)]

# Names: mostly real keys (so values get exercised), some near misses and junk.
names = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k[:-1]),
    st.text(string.ascii_letters + "._-", min_size=1, max_size=20),
)
values = st.one_of(
    st.text(max_size=12),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["true", "false", "bfloat16", "float16", "float32", "-1", "0", "", "a,b", "nan"]),
)
arg = st.one_of(
    st.tuples(names, values).map(lambda kv: [f"--{kv[0]}", kv[1]]),
    st.tuples(names, values).map(lambda kv: [f"--{kv[0]}={kv[1]}"]),
    names.map(lambda n: [f"--no-{n}"]),
    names.map(lambda n: [f"--{n}"]),
    values.map(lambda v: [v]),
)
argvs = st.lists(arg, max_size=4).map(lambda parts: [a for p in parts for a in p])


def _check_one_line(error: Exception) -> None:
    text = str(error)
    assert text and "\n" not in text, repr(text)


@settings(max_examples=400, deadline=None)
@given(argvs)
def test_cli_never_crashes(argv: list[str]) -> None:
    if any(a in ("-h", "--help", "--job.config_file") or a.startswith("--job.config_file=") for a in argv):
        return  # help exits early; config files are fuzzed below
    try:
        cfg.load_config(argv)
    except cfg.ConfigError as e:
        _check_one_line(e)


toml_scalars = st.one_of(
    st.integers(-(10**9), 10**9),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(string.printable, max_size=10),
    st.lists(st.text(string.ascii_letters, max_size=5), max_size=3),
)


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


tables = st.dictionaries(
    st.one_of(st.sampled_from(SECTIONS), st.text(string.ascii_lowercase + "_", min_size=1, max_size=8)),
    st.dictionaries(
        st.one_of(
            st.sampled_from(sorted({k.split(".")[1] for k in KEYS})),
            st.text(string.ascii_lowercase + "_", min_size=1, max_size=8),
        ),
        toml_scalars,
        max_size=4,
    ),
    max_size=3,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tables, st.binary(max_size=40))
def test_toml_never_crashes(tmp_path: Path, data: dict, junk: bytes) -> None:
    text = "\n".join(f"[{s}]\n" + "\n".join(f"{k} = {_toml_value(v)}" for k, v in kv.items()) for s, kv in data.items())
    for content in (text.encode(), junk):
        path = tmp_path / "job.toml"
        path.write_bytes(content)
        try:
            cfg.load_config(["--job.config_file", str(path)])
        except cfg.ConfigError as e:
            _check_one_line(e)


@pytest.mark.parametrize(
    "argv",
    [
        ["--training.stepz", "3"],
        ["--training.steps", "many"],
        ["--mixed_precision.param_dtype", "fp8"],
        ["--job.config_file", "/nonexistent.toml"],
        ["stray"],
    ],
)
def test_train_py_exits_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
