"""The shape rules of docs/architecture.md, checked on the source so they stay true as features land:
no module over 600 lines of code, no function over 80 (docstrings aside: documenting a function
must never push it over), every public function of three or more parameters says them in an
`Args:` section, and no import cycle between the package's modules (imports at module level; those
inside functions are the deliberate lazy ones)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_amp"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _module_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports when it is imported (not inside functions or
    `if TYPE_CHECKING:`), resolved to the longest known module name."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else (node,):
            if isinstance(sub, ast.Import):
                targets.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    anchor = package.split(".")[: len(package.split(".")) - sub.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.update(f"{base}.{a.name}" for a in sub.names)
    resolved = set()
    for t in targets:
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name:
            resolved.add(t)
    return resolved


Scope = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _docstring_lines(node: Scope) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].end_lineno - body[0].lineno + 1  # type: ignore[operator]
    return 0


def _code_lines(node: Scope, total: int) -> int:
    """`total` lines of `node` less the docstrings in it (its own and those of what it defines)."""
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return total - sum(_docstring_lines(n) for n in ast.walk(node) if isinstance(n, scopes))


def test_no_module_is_longer_than_600_lines():
    long = {}
    for name, path in _modules().items():
        text = path.read_text()
        long[name] = _code_lines(ast.parse(text), len(text.splitlines()))
    assert {n: k for n, k in long.items() if k > MAX_MODULE_LINES} == {}


def test_no_function_is_longer_than_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _code_lines(node, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


MIN_DOCUMENTED_PARAMS = 3


def _undocumented(tree: ast.Module, name: str) -> list[str]:
    """Public functions and methods of `tree` with MIN_DOCUMENTED_PARAMS or more parameters (self,
    cls and *args / **kwargs aside) whose docstring lacks an `Args:` section naming each."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        a = node.args
        params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
        if len(params) < MIN_DOCUMENTED_PARAMS:
            continue
        doc = ast.get_docstring(node) or ""
        args = doc.partition("Args:")[2]
        missing = [p for p in params if f"{p}:" not in args and f"{p} (" not in args]
        if "Args:" not in doc:
            out.append(f"{name}.{node.name}: no Args:")
        elif missing:
            out.append(f"{name}.{node.name}: Args: lacks {missing}")
    return out


def test_public_functions_of_three_or_more_parameters_say_them_in_args():
    found = [u for n, p in _modules().items() for u in _undocumented(ast.parse(p.read_text()), n)]
    assert found == []


SAMPLE = '''
def f(a, b, c):
    "Add."


def g(a, b, *, c):
    """Add.

    Args:
        a: one.
        b: two.
    """


def h(self, a, b):
    "Two parameters."


def _k(a, b, c):
    "Private."
'''


def test_the_args_check_sees_a_missing_and_a_forgotten_argument():
    assert _undocumented(ast.parse(SAMPLE), "m") == ["m.f: no Args:", "m.g: Args: lacks ['c']"]


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {n: _module_imports(n, p, set(modules)) for n, p in modules.items()}
    # A package's __init__ re-exporting its submodules is not a cycle with them: a submodule that
    # imports a sibling through the package name resolves to the sibling's own module here. One
    # that imports a name the __init__ defines or re-exports depends on the __init__, which is.
    cycles = _cycles(graph)
    assert cycles == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The checker itself: two modules importing each other at module level are found."""
    pkg = tmp_path / "torchtitan_amp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from torchtitan_amp import b\n")
    (pkg / "b.py").write_text("from torchtitan_amp.a import x\n")
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    with pytest.raises(AssertionError, match="torchtitan_amp.a"):
        test_no_import_cycle_between_modules()


# The packages from the bottom up: each imports only packages before it (and its own modules, in
# an order without cycles). docs/architecture.md draws the same order.
LAYERS = (
    "core",
    "config",
    "observability",
    "memory",
    "distributed",
    "models",
    "precision",
    "data",
    "checkpoint",
    "eval",
    "train",
    "",
    "tools",
)
ENTRY_POINTS = {"torchtitan_amp", "torchtitan_amp.main", "torchtitan_amp.launch", "torchtitan_amp.__main__"}


def _all_imports(name: str, path: Path, known: set[str]) -> set[tuple[str, int]]:
    """Every package module `name` imports, with the line: at module level, under
    `if TYPE_CHECKING:` and inside functions alike (a lazy import is still a dependency)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] or [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add((t, node.lineno))
    return found


def _layer(module: str) -> int:
    """The index in LAYERS of the top-level package `module` is in: a subpackage (models.llama3,
    precision.lowbit) takes its parent's layer."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 2 or (len(parts) == 2 and module not in ENTRY_POINTS) else ""
    return LAYERS.index(top)


def test_every_module_belongs_to_a_layer():
    assert [n for n in _modules() if n not in ENTRY_POINTS and n.split(".")[1] not in LAYERS] == []


def test_packages_import_only_the_layers_below_them():
    """No upward import between packages, type-only and in-function imports included."""
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target, line in sorted(_all_imports(name, path, set(modules))):
            if _layer(target) > _layer(name):
                upward.append(f"{name}:{line} -> {target}")
    assert upward == []


def test_no_import_cycle_within_a_package():
    """Inside a package the modules import each other in one direction too, type-only and
    in-function imports included (a package's __init__ re-exporting its modules aside)."""
    modules = _modules()
    graph = {n: {t for t, _ in _all_imports(n, p, set(modules))} for n, p in modules.items()}
    cycles = _cycles(graph)
    assert cycles == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    return cycles


def test_the_layer_check_sees_an_upward_and_a_type_only_cycle(tmp_path, monkeypatch):
    """The checkers themselves: a config module importing train lazily is upward; two precision
    modules importing each other, one only under TYPE_CHECKING, are a cycle."""
    pkg = tmp_path / "torchtitan_amp"
    for sub in ("config", "train", "precision"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "a.py").write_text("def f():\n    from torchtitan_amp.train import b\n")
    (pkg / "train" / "b.py").write_text("")
    (pkg / "precision" / "plan.py").write_text("from torchtitan_amp.precision import fsdp\n")
    (pkg / "precision" / "fsdp.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torchtitan_amp.precision.plan import P\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    with pytest.raises(AssertionError, match=r"torchtitan_amp.config.a:2 -> torchtitan_amp.train.b"):
        test_packages_import_only_the_layers_below_them()
    with pytest.raises(AssertionError, match="torchtitan_amp.precision.fsdp"):
        test_no_import_cycle_within_a_package()


def test_a_subpackage_takes_its_parents_layer_and_keeps_its_cycles_visible(tmp_path, monkeypatch):
    """The checkers on a subpackage (precision/lowbit/, as models/llama3/): its modules are in the
    precision layer (models below may be imported, data above may not), and a cycle through the
    parent package's __init__ (a lowbit module importing a name the __init__ re-exports from a
    module that imports lowbit) is a cycle."""
    pkg = tmp_path / "torchtitan_amp"
    for sub in ("models", "precision", "precision/lowbit", "data"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "m.py").write_text("")
    (pkg / "data" / "d.py").write_text("")
    (pkg / "precision" / "__init__.py").write_text("from torchtitan_amp.precision.plan import Plan\n")
    (pkg / "precision" / "plan.py").write_text("from torchtitan_amp.precision.lowbit import probe\nPlan = 1\n")
    (pkg / "precision" / "lowbit" / "probe.py").write_text(
        "from torchtitan_amp.models import m\n\ndef f():\n    from torchtitan_amp.data import d\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    with pytest.raises(AssertionError, match=r"torchtitan_amp.precision.lowbit.probe:4 -> torchtitan_amp.data.d") as e:
        test_packages_import_only_the_layers_below_them()
    assert "probe:1" not in str(e.value)  # models is below precision
    test_no_import_cycle_within_a_package()  # none yet
    (pkg / "precision" / "lowbit" / "probe.py").write_text("def f():\n    from torchtitan_amp.precision import Plan\n")
    with pytest.raises(AssertionError, match="torchtitan_amp.precision.lowbit.probe"):
        test_no_import_cycle_within_a_package()


PLAN_MAY_IMPORT = (
    "torchtitan_amp.precision.tags",
    "torchtitan_amp.precision.lowbit.",
    "torchtitan_amp.precision.lora_plan",  # [lora]'s decision (a part of the plan), not its applier
)


def test_the_plan_imports_no_applier():
    """precision/plan.py decides; the modules that apply its decision take the plan and are called
    with it. Of precision/ it imports the module tags (the marks it reads), the low-bit formats'
    probes, recipe and Linear class (precision/lowbit/) and [lora]'s decision (lora_plan.py, which
    imports no applier), nothing else, lazily or not."""
    modules = _modules()
    name = "torchtitan_amp.precision.plan"
    imported = {
        t for t, _ in _all_imports(name, modules[name], set(modules)) if t.startswith("torchtitan_amp.precision")
    }
    assert sorted(t for t in imported if not t.startswith(PLAN_MAY_IMPORT)) == []
    lowbit = {t for t in imported if t.startswith("torchtitan_amp.precision.lowbit.")}
    assert lowbit <= {f"torchtitan_amp.precision.lowbit.{m}" for m in ("capability", "formats", "linear")}


# Phrases of a hook, alias or import kept so that tests can replace something: tests patch the
# owner (monkeypatch) or build the objects themselves instead.
SEAM = ("tests replace", "tests patch", "(and tests)", "for tests that patch")


def test_the_checkpoint_package_keeps_no_seam_for_tests():
    seams = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for path in sorted((PACKAGE / "checkpoint").rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if any(s in line for s in SEAM)
    ]
    assert seams == []


def test_tests_import_no_benchmark():
    """benchmarks/ measure; tests check. A test runs a benchmark as a command (`python -m
    benchmarks.x`) when it checks one, and shares no code with it."""
    tests = PACKAGE.parent / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                found.append(f"{path.relative_to(tests)}:{node.lineno}")
    assert found == []
