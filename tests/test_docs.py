"""The documentation stays usable: README short, links that resolve, CI's test command in README.

CI (`.ci/run`) runs the test command that README shows; if the two drift apart, a reader of
README installs something other than what is tested. Relative links in README.md and docs/*.md
must name files (and headings) that exist, so a moved or renamed page is caught here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 260

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def _relative_links(path: Path) -> list[str]:
    links = LINK.findall(_prose(path.read_text()))
    return [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]


def _ci_test_command() -> str:
    """The install-and-test line of .ci/run (the one that ends in `python -m pytest -q`)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    found = [line.strip() for line in lines if line.strip().endswith("python -m pytest -q")]
    assert len(found) == 1, f".ci/run should hold one test command line, found {found}"
    return found[0]


def _without_pip_quiet(command: str) -> list[list[str]]:
    """A `a && b && c` command as its parts' words, pip's `-q` (output only) left out."""
    parts = [shlex.split(part) for part in command.split("&&")]
    return [[w for w in words if not (words[0] == "pip" and w == "-q")] for words in parts]


def test_readme_is_short():
    """README.md is an entry point, at most README_MAX_LINES lines; details live in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    """Every relative link of README.md and docs/*.md names an existing file, and its anchor (if
    any) a heading of that file."""
    broken = []
    for link in _relative_links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and anchor not in _anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_docs_exist():
    """The pages README's index promises are there."""
    names = {p.name for p in DOCS}
    expected = {
        "concepts.md",
        "cli.md",
        "configuration.md",
        "run-directory.md",
        "environments.md",
        "models.md",
        "gpu.md",
        "kernels.md",
        "benchmarks.md",
        "robustness.md",
        "development.md",
    }
    assert expected <= names, f"missing: {sorted(expected - names)}"


def test_readme_holds_ci_test_command():
    """README shows the command CI runs: the same parts in the same order (pip's -q aside)."""
    ci = _without_pip_quiet(_ci_test_command())
    shown = [
        _without_pip_quiet(line.strip())
        for line in README.read_text().splitlines()
        if "python -m pytest -q" in line
    ]
    matches = [parts for parts in shown if any(parts[i:] == ci for i in range(len(parts)))]
    assert matches, f"README.md has no line ending in the command of .ci/run: {ci}"


@pytest.mark.parametrize(
    "page",
    [README, ROOT / "CHANGELOG.md", *DOCS],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_no_word_session(page: Path):
    """The documentation speaks of the product: the word "session" does not appear."""
    hits = [
        f"line {n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"\bsessions?\b", line, re.IGNORECASE)
    ]
    assert not hits, f"{page.name}: " + "; ".join(hits)
