"""The user-facing docs (README.md, CONTRIBUTING.md, docs/*.md) state today's behaviour: no
development history (issue / round / session numbers, commit hashes, dates of past runs, "replaces
the table of ...", "(changed in this issue)"; git log holds that); every module path they name exists in the
package as it is laid out, and every relative link points to a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])

# Each pattern names one kind of history; matched case-insensitively, line by line.
HISTORY = {
    "issue/round/session number": r"(?<![-\w])(issues?|rounds?|sessions?|PR)\s+#?\d+",
    "this issue/round/session": r"\bthis (issue|round|session|sitting)\b",
    "commit hash": r"\bcommit\s+[0-9a-f]{7,40}\b|(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])",
    "date of a past run": r"\b20\d\d-[01]\d(-[0-3]\d)?\b",
    "replaces the ...": r"\breplaces? the (table|one|rows?|numbers?|run)\b",
    "changed in ...": r"\bchanged in\b",
    "then and now": r"\b(previously|no longer|used to|until recently|as before|before the fix|the old design"
    r"|earlier run|previous (run|sitting)|first session|(was|were) (added|removed|fixed|changed))\b",
    "new:": r"\(new\b[^)]*\)|(^|[-*|]\s*)\**new\**:",
}

# Lines where a pattern's words are technical, not history: (file name, pattern name, regex on the line).
ALLOWED = [
    ("checkpointing.md", "commit hash", r"CRC-32"),  # an example error line quoting CRC-32 checksums
]


def _hits(paths: list[Path], root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name, pattern in HISTORY.items():
                if not re.search(pattern, line, re.IGNORECASE):
                    continue
                if any(path.name == f and name == n and re.search(r, line) for f, n, r in ALLOWED):
                    continue
                found.append(f"{path.relative_to(root)}:{number}: {name}: {line.strip()[:120]}")
    return found


def test_the_docs_carry_no_development_history():
    assert _hits([p for p in DOCS if p.exists()]) == []


@pytest.mark.parametrize(
    "text, kind",
    [
        ("the suite (issue 41) takes", "issue/round/session number"),
        ("measured in round 3", "issue/round/session number"),
        ("session 12's numbers", "issue/round/session number"),
        ("since commit 37f38da", "commit hash"),
        ("at 0d4c9e1 the step took", "commit hash"),
        ("measured on 2026-11-30", "date of a past run"),
        ("This table replaces the one of", "replaces the ..."),
        ("(changed in this issue)", "changed in ..."),
        ("they used to get one group", "then and now"),
        ("the cache no longer bites", "then and now"),
        ("- **New:** async saves", "new:"),
    ],
)
def test_the_history_check_sees_each_kind(tmp_path, text, kind):
    doc = tmp_path / "a.md"
    doc.write_text(f"# A\n\n{text}\n")
    assert kind in {h.split(": ")[1] for h in _hits([doc], tmp_path)}


@pytest.mark.parametrize(
    "text",
    [
        "python -m benchmarks.ac_speed --rounds 8",
        "vocab 128256, 1769984 params",
        "`tokenizer.json` 3f",
        "a 4-byte `step`, seq 8192",
        "needs nothing new: routing",
    ],
)
def test_the_history_check_leaves_technical_text(tmp_path, text):
    doc = tmp_path / "a.md"
    doc.write_text(text + "\n")
    assert _hits([doc], tmp_path) == []


PACKAGES = (
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
    "tools",
)


def test_module_paths_in_the_docs_exist():
    """`torchtitan_amp/<...>.py` and `<package>/<module>.py` name files of today's layout."""
    pattern = re.compile(r"(?<![\w/.])(?:torchtitan_amp/)?((?:" + "|".join(PACKAGES) + r")/[\w/]*\w\.py)\b")
    top = re.compile(r"(?<![\w/.])torchtitan_amp/(\w+\.py)\b")
    missing = []
    for path in DOCS:
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for rel in pattern.findall(line) + top.findall(line):
                if not (REPO / "torchtitan_amp" / rel).exists():
                    missing.append(f"{path.relative_to(REPO)}:{number}: {rel}")
    assert missing == []


def test_relative_links_in_the_docs_point_to_files():
    missing = []
    for path in DOCS:
        if not path.exists():
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(REPO)}: {target}")
    assert missing == []


def test_the_readme_fits_in_150_lines():
    """The README is the front page (what, why, install, run, configure, where to read more); the
    rest belongs in docs/ and CONTRIBUTING.md."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
