"""Every link in the repository's Markdown, and every file path its text names, exists.

Links (``[text](target)``, images, reference definitions) to files must name an
existing file or folder, relative to the page; a ``#fragment`` must name a
heading of the target page (GitHub's anchors). Web links are not fetched: no
network where the tests run. File paths written as code (``bench/stats.py``) in
Markdown, and ``docs/*.md`` pages named in code comments and docstrings, must
exist too: a reader follows those by hand.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from common.install import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"!?\[(?:[^\]\n]|\][^(\n])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_FILE_IN_CODE = re.compile(r"^[\w.-]+(/[\w.-]+)*\.(md|py|sh|ya?ml|json|png|toml|txt)$")
_DOC_IN_SOURCE = re.compile(r"\bdocs/[\w./-]+\.md\b")


def _tracked(*patterns: str) -> list[Path]:
    """Files git would commit (tracked, or new and not ignored) matching ``patterns``."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *patterns],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


PAGES = _tracked("*.md")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(match) for match in _HEADING.findall(text)}


def _prose(page: Path) -> str:
    """The page without fenced code blocks (their brackets are code, not links)."""
    return _FENCE.sub("", page.read_text())


def _broken(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
        return None
    path_part, _, fragment = target.partition("#")
    resolved = (page.parent / path_part).resolve() if path_part else page
    if not resolved.exists():
        return f"{target}: {resolved} does not exist"
    if fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
        return f"{target}: no heading #{fragment} in {resolved.relative_to(ROOT)}"
    return None


def test_there_are_pages_to_check() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/operations.md", "CHANGELOG.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_point_somewhere(page: Path) -> None:
    prose = _CODE_SPAN.sub("", _prose(page))
    targets = _LINK.findall(prose) + _REFERENCE.findall(prose)
    broken = [problem for t in targets if (problem := _broken(page, t))]
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_file_paths_written_as_code_exist(page: Path) -> None:
    missing = []
    for span in _CODE_SPAN.findall(_prose(page)):
        named = _FILE_IN_CODE.match(span) and ("/" in span or span.endswith(".md"))
        if named and not ((ROOT / span).exists() or (page.parent / span).exists()):
            missing.append(span)
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_docs_named_in_source_exist() -> None:
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _tracked("*.py", "*.sh", "*.yml", "*.yaml", "*.toml", "Makefile", "Dockerfile*")
        for name in _DOC_IN_SOURCE.findall(path.read_text(errors="replace"))
        if not (ROOT / name).exists()
    ]
    assert not missing, f"references to pages that do not exist: {missing}"


def test_install_commands_name_the_distribution() -> None:
    """``pip install NAME`` in docs, hints and comments names conveyor-serve (or ``.``)."""
    command = re.compile(r"pip install (?:-[-\w]+ )*['\"]?([A-Za-z][\w.-]*)(\[[\w,]+\])?")
    wrong = []
    for path in _tracked("*.md", "*.py", "*.sh", "Dockerfile*", "*.toml"):
        for match in command.finditer(path.read_text(errors="replace")):
            name = match.group(1)
            if name.lower().startswith("conveyor") and name != DISTRIBUTION:
                wrong.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not wrong, f"install the distribution by its name, {DISTRIBUTION}: {wrong}"
