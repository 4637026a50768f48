"""Job config: TOML -> dataclasses, CLI overrides, precedence, --help, and one-line config errors.

Most checks run load_config in-process; a few go through `python train.py` to prove the user sees
exit code 2 and a single `error: ...` line without a traceback.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.support.launch import REPO, run_python
from torchtitan_amp import config as config_mod
from torchtitan_amp.config import (
    ConfigError,
    JobConfig,
    help_text,
    load_config,
    presentation,
    section_names,
    sections,
    to_toml,
)
from torchtitan_amp.config.bounds import Range
from torchtitan_amp.core import rules

pytestmark = pytest.mark.unit


def write(tmp_path: Path, text: str | bytes, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def load(tmp_path: Path, toml: str | None, *argv: str) -> JobConfig:
    args = list(argv)
    if toml is not None:
        args = ["--job.config_file", write(tmp_path, toml), *args]
    return load_config(args)


def error_of(tmp_path: Path, toml: str | None, *argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, toml, *argv)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def all_fields() -> list[tuple[str, dataclasses.Field]]:
    return [(s, f) for s in section_names() for f in dataclasses.fields(getattr(JobConfig(), s))]


# ---------------------------------------------------------------------------------------------
# TOML and defaults


def test_defaults_without_any_input() -> None:
    config = load_config([])
    assert config == JobConfig()
    assert config.training.seq_len == 2048 and config.mixed_precision.param_dtype == "bfloat16"
    assert config.explicit == set()


def test_toml_sections_map_to_dataclasses(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        [job]
        description = "a test"
        [optimizer]
        lr = 1            # an integer is a valid number
        [training]
        steps = 7
        seq_len = 32
        deterministic = true
        [parallelism]
        pipeline_parallel_split_points = ["layers.1", "layers.3"]
        [mixed_precision]
        lower_precision_safe_modules = "torch.nn.Linear, torch.nn.Embedding"
    """,
    )
    assert config.job.description == "a test"
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert (config.training.steps, config.training.seq_len, config.training.deterministic) == (7, 32, True)
    assert config.parallelism.pipeline_parallel_split_points == ["layers.1", "layers.3"]
    assert config.mixed_precision.lower_precision_safe_modules == ["torch.nn.Linear", "torch.nn.Embedding"]
    # Untouched fields keep their defaults.
    assert config.training.local_batch_size == JobConfig().training.local_batch_size
    assert "training.steps" in config.explicit and "training.local_batch_size" not in config.explicit


def test_every_shipped_config_loads() -> None:
    configs = sorted((REPO / "train_configs").glob("*.toml"))
    assert configs
    for path in configs:
        config = load_config(["--job.config_file", str(path)])
        assert config.job.config_file == str(path)


# ---------------------------------------------------------------------------------------------
# CLI overrides


@pytest.mark.parametrize(
    "argv",
    [
        ["--training.steps", "7"],
        ["--training.steps=7"],
    ],
)
def test_cli_value_forms(argv: list[str]) -> None:
    assert load_config(argv).training.steps == 7


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--compile.enable"], True),  # bare flag
        (["--compile.enable", "--training.steps", "3"], True),  # bare flag before another option
        (["--compile.enable", "true"], True),
        (["--compile.enable", "True"], True),
        (["--compile.enable", "false"], False),
        (["--compile.enable=false"], False),
        (["--compile.enable=true"], True),
        (["--compile.enable", "--no-compile.enable"], False),
        (["--no-compile.enable"], False),
    ],
)
def test_cli_booleans(argv: list[str], expected: bool) -> None:
    assert load_config(argv).compile.enable is expected


def test_no_flag_turns_off_a_default_true() -> None:
    assert JobConfig().training.deterministic is False and JobConfig().metrics.enable_tensorboard is False
    assert load_config(["--no-parallelism.enable_sequence_parallel"]).parallelism.enable_sequence_parallel is False


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "auto"),
        (["--no-mixed_precision.enabled"], False),
        (["--mixed_precision.enabled"], True),
        (["--mixed_precision.enabled", "auto"], "auto"),
        (["--mixed_precision.enabled=AUTO"], "auto"),
        (["--mixed_precision.enabled", "false"], False),
        (["--mixed_precision.enabled", "--training.steps", "3"], True),
        (["--mixed_precision.enabled", "auto", "--no-mixed_precision.enabled"], False),
    ],
)
def test_mixed_precision_enabled_is_a_boolean_or_auto(argv: list[str], expected: object) -> None:
    assert load_config(argv).mixed_precision.enabled == expected
    assert type(load_config(argv).mixed_precision.enabled) is type(expected)


@pytest.mark.parametrize(("toml", "expected"), [("true", True), ("false", False), ('"auto"', "auto")])
def test_mixed_precision_enabled_from_toml_round_trips(tmp_path: Path, toml: str, expected: object) -> None:
    path = tmp_path / "job.toml"
    path.write_text(f"[mixed_precision]\nenabled = {toml}\n")
    config = load_config(["--job.config_file", str(path)])
    assert config.mixed_precision.enabled == expected
    path.write_text(to_toml(config))
    assert load_config(["--job.config_file", str(path)]).mixed_precision.enabled == expected


@pytest.mark.parametrize(("toml", "cli"), [('"on"', None), ("1", None), (None, "maybe")])
def test_mixed_precision_enabled_rejects_other_values(tmp_path: Path, toml: str | None, cli: str | None) -> None:
    argv = [f"--mixed_precision.enabled={cli}"] if cli else []
    if toml:
        path = tmp_path / "job.toml"
        path.write_text(f"[mixed_precision]\nenabled = {toml}\n")
        argv = ["--job.config_file", str(path)]
    with pytest.raises(ConfigError, match="mixed_precision.enabled") as e:
        load_config(argv)
    assert "auto" in str(e.value)


def test_cli_lists_are_comma_separated() -> None:
    config = load_config(
        [
            "--mixed_precision.lower_precision_safe_modules",
            "torch.nn.Linear, torch.nn.Embedding,",
            "--parallelism.pipeline_parallel_split_points=layers.2",
        ]
    )
    assert config.mixed_precision.lower_precision_safe_modules == ["torch.nn.Linear", "torch.nn.Embedding"]
    assert config.parallelism.pipeline_parallel_split_points == ["layers.2"]


def test_cli_negative_numbers_are_values() -> None:
    config = load_config(
        [
            "--training.global_batch_size",
            "-1",
            "--parallelism.data_parallel_shard_degree",
            "-1",
            "--lr_scheduler.decay_ratio",
            "-1",
        ]
    )
    assert config.training.global_batch_size == -1 and config.lr_scheduler.decay_ratio == -1.0


def test_cli_value_cannot_swallow_the_next_option() -> None:
    # `--job.description --training.steps 3` forgot the description; it must not become one.
    with pytest.raises(ConfigError, match=r"'--job.description' needs a value"):
        load_config(["--job.description", "--training.steps", "3"])
    # A value that really starts with -- can still be given with '='.
    assert load_config(["--job.description=--odd"]).job.description == "--odd"


def test_precedence_cli_over_toml_over_defaults(tmp_path: Path) -> None:
    toml = "[training]\nsteps = 5\nseq_len = 32\n"
    defaults = JobConfig().training
    for argv in (["--training.steps", "9"], []):
        config = load(tmp_path, toml, *argv)
        assert config.training.seq_len == 32  # TOML over default
        assert config.training.steps == (9 if argv else 5)  # CLI over TOML
        assert config.training.local_batch_size == defaults.local_batch_size  # default
    # The CLI wins even when it comes before --job.config_file on the command line.
    path = write(tmp_path, toml)
    assert load_config(["--training.steps", "9", "--job.config_file", path]).training.steps == 9


def test_repeated_overrides_last_wins(tmp_path: Path) -> None:
    a = write(tmp_path, "[training]\nsteps = 1\n", "a.toml")
    b = write(tmp_path, "[training]\nsteps = 2\n", "b.toml")
    assert load_config(["--training.steps", "3", "--training.steps", "4"]).training.steps == 4
    config = load_config(["--job.config_file", a, "--job.config_file", b])
    assert config.job.config_file == b and config.training.steps == 2


# ---------------------------------------------------------------------------------------------
# torchtitan's spelling of the precision dtypes


def test_alias_sets_the_canonical_field() -> None:
    config = load_config(
        ["--training.mixed_precision_param", "float16", "--training.mixed_precision_reduce", "bfloat16"]
    )
    assert config.mixed_precision.param_dtype == "float16"
    assert config.mixed_precision.reduce_dtype == "bfloat16"


@pytest.mark.parametrize(
    "alias, canonical",
    [
        ("training.mixed_precision_param", "mixed_precision.param_dtype"),
        ("training.mixed_precision_reduce", "mixed_precision.reduce_dtype"),
    ],
)
def test_alias_and_canonical_set_differently_is_an_error(tmp_path: Path, alias: str, canonical: str) -> None:
    message = error_of(tmp_path, None, f"--{alias}", "float16", f"--{canonical}", "float32")
    assert alias in message and canonical in message and "set only one" in message
    a_sec, a_key = alias.split(".")
    c_sec, c_key = canonical.split(".")
    toml = f'[{a_sec}]\n{a_key} = "float16"\n[{c_sec}]\n{c_key} = "float32"\n'
    message = error_of(tmp_path, toml)
    assert alias in message and canonical in message
    # The same value under both names is consistent, not a conflict.
    config = load_config([f"--{alias}", "float16", f"--{canonical}", "float16"])
    assert getattr(getattr(config, c_sec), c_key) == "float16"


def test_alias_follows_precedence_across_sources(tmp_path: Path) -> None:
    # The shipped debug config sets mixed_precision.param_dtype; the torchtitan spelling on the
    # command line must override it like any other CLI value.
    config = load(
        tmp_path, '[mixed_precision]\nparam_dtype = "bfloat16"\n', "--training.mixed_precision_param", "float16"
    )
    assert config.mixed_precision.param_dtype == "float16"
    config = load(
        tmp_path, '[training]\nmixed_precision_param = "float16"\n', "--mixed_precision.param_dtype", "float32"
    )
    assert config.mixed_precision.param_dtype == "float32"
    assert config.training.mixed_precision_param == "float32"  # the resolved config agrees with itself


# ---------------------------------------------------------------------------------------------
# --help and --job.print_config


def test_help_lists_every_field_with_default_and_doc() -> None:
    text = help_text()
    for section, f in all_fields():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(f"--{section}.{f.name} ")), None)
        assert line is not None, f"--{section}.{f.name} missing from --help"
        assert f"(default {presentation._format_value(default)})" in line
        assert f.metadata["help"] in text
        for choice in config_mod.field_choices(section, f.name) or ():
            assert presentation._format_choice(choice) in line
    assert "Precedence: CLI > TOML" in text
    flavor = next(ln for ln in text.splitlines() if ln.strip().startswith("--model.flavor "))
    # every family's flavors (core.rules' torch-free table), each name once, in registry order
    every = dict.fromkeys(name for flavors in rules.FAMILIES.values() for name in flavors)
    assert flavor.endswith("{" + ", ".join(every) + "}")


def test_help_says_what_a_field_does_not_what_was_measured() -> None:
    # Measurements (timings, speed-ups, the machine they came from) live in docs/performance.md.
    measured = re.compile(r"[Mm]easured on|\d+(\.\d+)?\s*(%|x) (faster|slower)")
    assert [f"{s}.{f.name}" for s, f in all_fields() if measured.search(f.metadata["help"])] == []


def test_section_classes_end_in_config_and_are_exported() -> None:
    for section in section_names():
        cls = type(getattr(JobConfig(), section))
        assert cls.__name__.endswith("Config") and getattr(config_mod, cls.__name__) is cls, cls.__name__
    assert sections.option.__doc__ and not hasattr(sections, "_f")  # the field helper has a real name


def test_fault_injection_is_set_in_the_debug_section(tmp_path: Path) -> None:
    config = load(tmp_path, "[debug]\nfault_inject_at_step = 3\n", "--debug.fault_inject_rank", "1")
    assert (config.debug.fault_inject_at_step, config.debug.fault_inject_rank) == (3, 1)
    assert not hasattr(config.training, "fault_inject_at_step")


@pytest.mark.parametrize("key", ["fault_inject_at_step", "fault_inject_rank"])
def test_fault_injection_under_training_says_where_it_moved(tmp_path: Path, key: str) -> None:
    expected = f"unknown config key 'training.{key}': it moved to 'debug.{key}' ([debug])"
    assert error_of(tmp_path, None, f"--training.{key}", "1") == expected
    assert error_of(tmp_path, f"[training]\n{key} = 1\n") == expected


# ---------------------------------------------------------------------------------------------
# Single-field bounds: declared on the field, checked as it is set, shown by --help


def _outside(bounds: Range) -> list[float]:
    """Values just outside a Range, at each end, that none of its special values covers."""
    near = [
        x
        for end in (bounds.low, bounds.high)
        if end is not None
        for x in (end - 1, end - 0.5, end, end + 0.5, end + 1, end - 2)
    ]
    return [x for x in near if not bounds.contains(x)]


def test_a_range_without_either_end_is_refused_where_it_is_declared() -> None:
    # It would bound nothing, and --help could not describe it (describe() had no end to print).
    with pytest.raises(ValueError, match="low or high"):
        Range()
    assert Range(high=3).describe() == "<= 3" and Range(low=0).describe() == ">= 0"


def bounded_fields() -> list[tuple[str, str, object]]:
    return [(s, f.name, f.metadata["bounds"]) for s, f in all_fields() if "bounds" in f.metadata]


def test_every_bound_is_in_help_and_holds_for_its_default() -> None:
    lines = help_text().splitlines()
    assert len(bounded_fields()) >= 40
    for section, key, bounds in bounded_fields():
        line = next(ln for ln in lines if ln.strip().startswith(f"--{section}.{key} "))
        assert line.endswith(f"  ({bounds.describe()})"), line
        assert bounds.problem(f"{section}.{key}", getattr(getattr(JobConfig(), section), key)) is None


def test_a_value_outside_its_bounds_is_one_line_naming_the_field_and_the_range(tmp_path: Path) -> None:
    for section, key, bounds in bounded_fields():
        if not isinstance(bounds, Range):
            continue
        is_int = isinstance(getattr(getattr(JobConfig(), section), key), int)
        for value in _outside(bounds):
            if is_int and not float(value).is_integer():
                continue
            text = str(int(value)) if is_int else str(value)
            shown = int(value) if is_int else float(value)
            expected = f"'{section}.{key}' must be {bounds.describe()}, got {shown}"
            assert error_of(tmp_path, None, f"--{section}.{key}={text}") == expected
            assert error_of(tmp_path, f"[{section}]\n{key} = {text}\n") == expected


@pytest.mark.parametrize(
    "section, key, described",
    [
        ("training", "steps", ">= 1"),
        ("training", "global_batch_size", "-1 or >= 1"),
        ("optimizer", "beta2", "in [0, 1)"),
        ("optimizer", "lr", "> 0"),
        ("lr_scheduler", "decay_ratio", "-1 or in [0, 1]"),
        ("mixed_precision", "backoff_factor", "in (0, 1)"),
        ("validation", "steps", "-1 (the whole split) or >= 1"),
        ("validation", "seq_len", "0 (training's) or >= 2"),
        ("validation", "sample_temperature", ">= 0 (0: greedy)"),
        ("metrics", "wandb_project", "at most 128 characters, none of / \\ # ? % :"),
        ("metrics", "wandb_tags", "each tag 1-64 characters"),
    ],
)
def test_help_shows_what_a_field_allows(section: str, key: str, described: str) -> None:
    line = next(ln for ln in help_text().splitlines() if ln.strip().startswith(f"--{section}.{key} "))
    assert line.endswith(f"  ({described})"), line


def test_a_bad_value_in_the_file_is_refused_even_when_the_command_line_overrides_it(tmp_path: Path) -> None:
    # As a wrongly typed or unknown value is: the file itself is wrong.
    message = error_of(tmp_path, "[training]\nsteps = 0\n", "--training.steps", "5")
    assert message == "'training.steps' must be >= 1, got 0"


def test_train_py_help_exits_0() -> None:
    result = run_python("train.py", "--help", timeout=60)
    assert result.returncode == 0, result.describe()
    assert "--training.local_batch_size (default 8)" in result.stdout
    assert "--mixed_precision.param_dtype" in result.stdout and result.stderr == ""


def test_printed_config_round_trips(tmp_path: Path) -> None:
    config = load_config(
        [
            "--training.steps",
            "3",
            "--job.description",
            'say "hi" \\ bye',
            "--mixed_precision.lower_precision_safe_modules",
            "torch.nn.Linear,torch.nn.Embedding",
            "--optimizer.eps",
            "1e-12",
            "--no-mixed_precision.enabled",
        ]
    )
    again = load_config(["--job.config_file", write(tmp_path, to_toml(config))])
    again.job.config_file = config.job.config_file
    assert again == config


# ---------------------------------------------------------------------------------------------
# model.flavor: the names of models/llama.py's registry, which a tool may extend at run time


def test_a_flavor_registered_at_run_time_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_amp.models.llama3 import model as llama

    # As the GPU check fp8_speed registers its 8B-shaped 2-block stack; undone after the test.
    monkeypatch.setitem(
        llama.LLAMA3_FLAVORS, "debugmodel_2l", dataclasses.replace(llama.LLAMA3_FLAVORS["debugmodel"], n_layers=2)
    )
    assert load_config(["--model.flavor", "debugmodel_2l"]).model.flavor == "debugmodel_2l"
    assert load(tmp_path, '[model]\nflavor = "debugmodel_2l"\n').model.flavor == "debugmodel_2l"
    assert "debugmodel_2l," in next(ln for ln in help_text().splitlines() if "--model.flavor " in ln)
    assert llama.build_model_args("debugmodel_2l", 258, 64).n_layers == 2


# Llama's flavors after 3.1's sizes, and the MoE family's, listed after Llama's when a flavor is
# unknown to every family.
LLAMA_SIZES = ", 'llama3_2_1b', 'llama3_2_3b', 'llama3_0_8b', 'llama3_0_70b'"
# The other built-in families' flavors (core.rules' torch-free table), in registry order, each once.
OTHER_FAMILIES_FLAVORS = "".join(
    f", {name!r}"
    for name in dict.fromkeys(f for family, flavors in rules.FAMILIES.items() if family != "llama3" for f in flavors)
    if name not in rules.FAMILIES["llama3"]
)


def test_an_unknown_flavor_is_refused_in_one_line_listing_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan_amp.models.llama3 import model as llama

    message = error_of(tmp_path, None, "--model.flavor", "llama3_8b_2l")
    assert message == (
        "'model.flavor' = 'llama3_8b_2l' is not allowed; choose one of: 'debugmodel', "
        "'debugmodel_h64', 'debugmodel_tiny', 'llama3_8b', 'llama3_70b', 'llama3_405b'"
        + LLAMA_SIZES
        + OTHER_FAMILIES_FLAVORS
    )
    monkeypatch.setitem(llama.LLAMA3_FLAVORS, "llama3_8b_2l", llama.LLAMA3_FLAVORS["llama3_8b"])
    assert "'llama3_0_70b', 'llama3_8b_2l'" in error_of(tmp_path, '[model]\nflavor = "llama3_8b_3l"\n')


def test_flavors_are_checked_without_importing_torch() -> None:
    """Config parsing stays torch-free (a mistyped override fails in a fraction of a second): before
    models/llama.py is imported nothing can be registered, so rules.FLAVORS answers."""
    code = (
        "import sys; from torchtitan_amp.config import load_config, ConfigError\n"
        "assert load_config(['--model.flavor', 'llama3_70b']).model.flavor == 'llama3_70b'\n"
        "try: load_config(['--model.flavor', 'huge'])\nexcept ConfigError as e: print(e)\n"
        "print('torch' in sys.modules)"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.describe()
    assert result.stdout.splitlines() == [
        "'model.flavor' = 'huge' is not allowed; choose one of: 'debugmodel', 'debugmodel_h64', 'debugmodel_tiny', "
        "'llama3_8b', 'llama3_70b', 'llama3_405b'" + LLAMA_SIZES + OTHER_FAMILIES_FLAVORS,
        "False",
    ]


# ---------------------------------------------------------------------------------------------
# Errors: one line, naming the field and what is allowed


@pytest.mark.parametrize(
    "toml, argv, expected",
    [
        # unknown section / key, with the closest valid name
        (None, ["--trainig.steps", "3"], ["unknown config section 'trainig'", "did you mean 'training'"]),
        (None, ["--training.step", "3"], ["unknown config key 'training.step'", "did you mean 'training.steps'"]),
        (None, ["--mixed_precision.param_dtyp=float16"], ["did you mean 'mixed_precision.param_dtype'"]),
        ("[optimiser]\nlr = 1.0\n", [], ["unknown config section 'optimiser'", "did you mean 'optimizer'"]),
        (
            "[training]\nlocal_batch = 2\n",
            [],
            ["unknown config key 'training.local_batch'", "did you mean 'training.local_batch_size'"],
        ),
        ("training = 3\n", [], ["'training' must be a TOML table"]),
        # wrong type
        (None, ["--training.steps", "ten"], ["'--training.steps' must be an integer, got 'ten'"]),
        (None, ["--training.steps", "2.5"], ["'--training.steps' must be an integer"]),
        (None, ["--optimizer.lr", "fast"], ["'--optimizer.lr' must be a", "number, got 'fast'"]),
        (None, ["--compile.enable=maybe"], ["'--compile.enable' must be true or false"]),
        ('[training]\nsteps = "10"\n', [], ["'training.steps' must be an integer, got '10'"]),
        ("[training]\nsteps = 10.0\n", [], ["'training.steps' must be an integer"]),
        ("[optimizer]\nlr = true\n", [], ["'optimizer.lr' must be a", "number, got True"]),
        ('[compile]\nenable = "yes"\n', [], ["'compile.enable' must be true or false"]),
        ("[mixed_precision]\nlower_precision_safe_modules = [1]\n", [], ["must be a list of strings"]),
        # outside the allowed set, listing it
        (
            None,
            ["--model.flavor", "tiny"],
            [
                "'model.flavor' = 'tiny' is not allowed",
                "'debugmodel', 'debugmodel_h64', 'debugmodel_tiny', 'llama3_8b'",
            ],
        ),
        (None, ["--mixed_precision.param_dtype", "fp16"], ["'float32', 'bfloat16', 'float16'"]),
        (None, ["--training.mixed_precision_reduce", "fp8"], ["'training.mixed_precision_reduce' = 'fp8'"]),
        (
            '[lr_scheduler]\ndecay_type = "step"\n',
            [],
            ["'lr_scheduler.decay_type' = 'step'", "'linear', 'cosine', 'sqrt'"],
        ),
        # inconsistent or out-of-range values that need no world size
        (None, ["--training.seq_len", "1"], ["'training.seq_len' must be >= 2, got 1"]),
        (None, ["--training.local_batch_size", "0"], ["'training.local_batch_size' must be >= 1"]),
        (None, ["--training.global_batch_size", "0"], ["'training.global_batch_size' must be -1 or >= 1"]),
        (None, ["--training.steps", "0"], ["'training.steps' must be >= 1"]),
        (None, ["--optimizer.lr", "0"], ["'optimizer.lr' must be > 0"]),
        (None, ["--lr_scheduler.warmup_steps", "-1"], ["'lr_scheduler.warmup_steps' must be >= 0"]),
        (None, ["--lr_scheduler.min_lr_factor", "1.5"], ["'lr_scheduler.min_lr_factor' must be in [0, 1]"]),
        (None, ["--lr_scheduler.decay_ratio", "2"], ["'lr_scheduler.decay_ratio' must be -1 or in [0, 1]"]),
        (None, ["--parallelism.data_parallel_shard_degree", "0"], ["'parallelism.data_parallel_shard_degree'"]),
        (None, ["--metrics.log_freq", "0"], ["'metrics.log_freq' must be >= 1"]),
        (None, ["--parallelism.ddp_bucket_cap_mb", "0"], ["'parallelism.ddp_bucket_cap_mb' must be > 0, got 0.0"]),
        (None, ["--parallelism.ddp_bucket_cap_mb", "big"], ["'--parallelism.ddp_bucket_cap_mb' must be a"]),
        (None, ["--mixed_precision.backoff_factor", "1"], ["'mixed_precision.backoff_factor' must be in (0, 1)"]),
        # malformed command lines
        (None, ["steps=3"], ["unexpected argument 'steps=3'"]),
        (None, ["--training.steps"], ["'--training.steps' needs a value"]),
        (None, ["--no-training.steps"], ["'--no-training.steps' only applies to boolean fields"]),
        (None, ["--no-compile.enable=true"], ["only applies to boolean fields without a value"]),
    ],
)
def test_config_errors(tmp_path: Path, toml: str | None, argv: list[str], expected: list[str]) -> None:
    message = error_of(tmp_path, toml, *argv)
    for part in expected:
        assert part in message, message


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file '.*nope.toml' does not exist"):
        load_config(["--job.config_file", str(tmp_path / "nope.toml")])


def test_invalid_toml(tmp_path: Path) -> None:
    message = error_of(tmp_path, "[training]\nsteps = = 3\n")
    assert "is not valid TOML" in message and "line 2" in message


def test_non_utf8_toml(tmp_path: Path) -> None:
    path = write(tmp_path, b'[job]\ndescription = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text|is not valid TOML"):
        load_config(["--job.config_file", path])


def test_no_config_error_leaves_a_partial_config(tmp_path: Path) -> None:
    """A failing load raises instead of returning a config with some fields silently skipped."""
    with pytest.raises(ConfigError):
        load(tmp_path, "[training]\nsteps = 3\nbogus = 1\n")


# ---------------------------------------------------------------------------------------------
# Checks that need the world size run in Trainer before any process group or model exists


@pytest.fixture
def no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes starting a process group or building the model a test failure."""
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.train import build

    def forbidden(*_args, **_kwargs):
        raise AssertionError("a bad config reached process-group / model construction")

    monkeypatch.setattr(process_groups, "init", forbidden)
    monkeypatch.setattr(build, "build_model", forbidden)
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize(
    "world_size, argv, expected",
    [
        (
            2,
            ["--training.local_batch_size", "4", "--training.global_batch_size", "12"],
            ["'training.global_batch_size' = 12 is not a multiple of", "4 x 2 = 8"],
        ),
        (1, ["--training.local_batch_size", "4", "--training.global_batch_size", "6"], ["is not a multiple of"]),
        (2, ["--parallelism.data_parallel_replicate_degree", "3"], ["does not divide the world size 2"]),
        (
            4,
            ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
            ["differs from the world size 4"],
        ),
        (1, ["--parallelism.data_parallel_shard_degree", "2"], ["differs from the world size 1"]),
    ],
)
def test_world_size_checks_run_before_any_process_group(
    no_process_group: None, monkeypatch: pytest.MonkeyPatch, world_size: int, argv: list[str], expected: list[str]
) -> None:
    from torchtitan_amp.train.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    config = load_config(["--training.seq_len", "16", *argv])
    with pytest.raises(ConfigError) as info:
        Trainer(config)
    for part in expected:
        assert part in str(info.value)
    assert "\n" not in str(info.value)


# Configs that cannot run on their world size, each with what its one error line says. The
# pre-flight (torchtitan_amp/train/preflight.py) finds them before torchrun starts; the launches
# through run_llama_train.sh and torchtitan_amp.launch are in tests/test_multinode.py.
DEBUG_CONFIG = ("--job.config_file", "train_configs/debug_model.toml")
_TINY = ("--model.flavor", "debugmodel_tiny")
_MOE = ("--model.name", "moe", "--model.flavor", "debugmodel_moe")
WORLD_SIZE_ERRORS = [
    (2, ["--parallelism.expert_parallel_degree", "2"], "needs a model with routed experts"),
    (
        2,
        ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
        "'training.seq_len' = 66 must be divisible by 2 x context_parallel_degree = 4",
    ),
    (2, ["--parallelism.data_parallel_shard_degree", "4"], "= 4 differs from the world size 2"),
    (3, ["--parallelism.tensor_parallel_degree", "2"], "= 2 does not divide the world size 3"),
    (2, ["--parallelism.data_parallel_replicate_degree", "3"], "= 3 does not divide the world size 2"),
    (2, ["--training.global_batch_size", "24"], "is not a multiple of local_batch_size x dp degree = 8 x 2"),
    (
        2,
        [*_MOE, "--parallelism.expert_parallel_degree", "4"],
        "'parallelism.expert_parallel_degree' = 4 must divide data_parallel_shard_degree x context_parallel_degree",
    ),
    (6, [*_MOE, "--parallelism.expert_parallel_degree", "3"], "= 3 must divide the model's n_routed_experts = 8"),
    (4, [*_TINY, "--parallelism.tensor_parallel_degree", "4"], "= 4 must divide the model's n_heads = 2"),
    (8, [*_TINY, "--parallelism.pipeline_parallel_degree", "8"], "8 pipeline stages need at least as many layers"),
    (
        2,
        [*_TINY, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
        "must be a multiple of 'parallelism.pipeline_parallel_microbatch_size' = 3",
    ),
    (
        2,
        [*_TINY, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
        "'training.seq_len' = 63 must be divisible by tensor_parallel_degree = 2 with sequence parallel on",
    ),
]


@pytest.mark.parametrize("world_size, argv, expected", WORLD_SIZE_ERRORS)
def test_preflight_finds_world_size_errors_in_one_line(
    capsys: pytest.CaptureFixture, no_process_group: None, world_size: int, argv: list[str], expected: str
) -> None:
    from torchtitan_amp.train import preflight

    assert preflight.check(world_size, [*DEBUG_CONFIG, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


def test_preflight_passes_a_good_config_silently(capsys: pytest.CaptureFixture, no_process_group: None) -> None:
    from torchtitan_amp.train import preflight

    assert preflight.check(2, [*DEBUG_CONFIG]) == 0
    assert preflight.check(2, [*DEBUG_CONFIG, "--parallelism.expert_parallel_degree", "2", "--help"]) == 0
    assert preflight.check(1, [*DEBUG_CONFIG, "--parallelism.data_parallel_shard_degree", "2", "--job.dry_run"]) == 0
    assert capsys.readouterr() == ("", "")


def test_preflight_reads_the_world_size_and_the_script_from_torchruns_options() -> None:
    from torchtitan_amp.train.preflight import training_job

    args = ["train.py", *DEBUG_CONFIG]
    assert training_job(["--standalone", "--nproc_per_node=2", *args]) == (2, list(DEBUG_CONFIG))
    assert training_job(["--nnodes", "2", "--nproc_per_node", "3", "--rdzv_id", "x", *args]) == (6, list(DEBUG_CONFIG))
    assert training_job(["--nproc_per_node=2", "-m", "torchtitan_amp", "--x.y", "1"]) == (2, ["--x.y", "1"])
    assert training_job(["--nnodes", "1:4", "--nproc_per_node=2", *args]) is None  # elastic: decided at rendezvous
    assert training_job(["--nproc_per_node=2", "tests/workers/layouts.py", "spec.json"]) is None  # not a config
    assert training_job(["--no-such-option", *args]) is None  # torchrun reports its own usage errors


# ---------------------------------------------------------------------------------------------
# What the user sees: exit code 2, one line on stderr, no traceback


def assert_one_line_error(result, *expected: str) -> None:
    assert result.returncode == 2, result.describe()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.describe()
    assert "Traceback" not in result.output
    for part in expected:
        assert part in lines[0], lines[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.stepz", "3"], ["did you mean 'training.steps'"]),
        (["--model.flavor", "huge"], ["is not allowed; choose one of:"]),
        (["--job.config_file", "does/not/exist.toml"], ["config file 'does/not/exist.toml' does not exist"]),
    ],
)
def test_train_py_rejects_bad_config(args: list[str], expected: list[str]) -> None:
    assert_one_line_error(run_python("train.py", *args, timeout=60), *expected)


def test_train_py_rejects_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "[training\nsteps = 3\n")
    assert_one_line_error(run_python("train.py", "--job.config_file", path, timeout=60), "is not valid TOML")


def test_train_py_rejects_world_size_mismatch() -> None:
    # Found by Trainer (needs torch and the world size), still before any process group.
    result = run_python(
        "train.py", "--parallelism.data_parallel_shard_degree", "2", "--training.seq_len", "16", timeout=120
    )
    assert_one_line_error(result, "differs from the world size 1")
