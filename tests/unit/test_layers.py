"""The rooms of ``workers/`` and their floors, as docs/architecture.md draws them.

docs/architecture.md has a table of the rooms (each sub-package, and each module
at the top of ``workers/``), the floor each stands on and the rooms it imports.
This test reads that table and the code's imports (``test_import_graph`` parses
them) and fails when the two disagree, in either direction, or when an import
runs to a room on the same floor or above. So the picture stays true, the graph
has no cycles (every arrow goes down) and a new arrow is a decision written down.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from tests.imports import Import, imports_in, module_name

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
MAX_MODULES = 12  # in one folder: a room's own modules, or a sub-folder's (handlers/tasks)
_ROW = re.compile(r"^\| (\d+) \| `workers\.(\w+)` \|[^|]*\|\s*([\w, ]*?)\s*\|$")


def room_of(module: str) -> str | None:
    """The room of a module of ``workers``: its sub-package, or itself at the top."""
    parts = module.split(".")
    if parts[0] != "workers" or len(parts) < 2:
        return None
    return parts[1]


def drawn(doc: str) -> dict[str, tuple[int, frozenset[str]]]:
    """Room -> (floor, rooms it imports), from the doc's table."""
    rooms = {}
    for line in doc.splitlines():
        row = _ROW.match(line)
        if row:
            floor, room, imports = row.groups()
            names = frozenset(name.strip() for name in imports.split(",") if name.strip())
            rooms[room] = (int(floor), names)
    return rooms


def arrows(root: Path) -> dict[str, set[str]]:
    """Room -> the other rooms of ``workers`` its modules import."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted((root / "workers").rglob("*.py")):
        module = module_name(path, root)
        source = room_of(module)
        if source is None:
            continue  # workers/__init__.py: the package, no room
        found.setdefault(source, set())
        for imported in imports_in(path.read_text(), module, path.name == "__init__.py"):
            target = _target_room(imported, root)
            if target is not None and target != source:
                found[source].add(target)
    return found


def _target_room(imported: Import, root: Path) -> str | None:
    parts = imported.target.split(".")
    if parts[0] != "workers" or len(parts) < 2:
        return None
    name = parts[1]
    if (root / "workers" / name).is_dir() or (root / "workers" / f"{name}.py").exists():
        return name
    return None  # `from workers import x` of something that is no room


def broken(rooms: dict[str, tuple[int, frozenset[str]]], code: dict[str, set[str]]) -> list[str]:
    """Every disagreement between the drawing and the code, one line each."""
    problems = []
    for room in sorted(set(code) - set(rooms)):
        problems.append(f"workers.{room} is not in the table")
    for room in sorted(set(rooms) - set(code)):
        problems.append(f"workers.{room} is in the table but not in the code")
    for room, targets in sorted(code.items()):
        if room not in rooms:
            continue
        floor, listed = rooms[room]
        for target in sorted(targets - listed):
            problems.append(f"workers.{room} imports workers.{target}, which the table omits")
        for target in sorted(listed - targets):
            problems.append(f"workers.{room} no longer imports workers.{target}")
        for target in sorted(targets):
            if target in rooms and rooms[target][0] >= floor:
                problems.append(
                    f"workers.{room} (floor {floor}) imports workers.{target} "
                    f"(floor {rooms[target][0]}): arrows go down"
                )
    return problems


def test_the_drawing_matches_the_imports() -> None:
    rooms = drawn(DOC.read_text())
    assert len(rooms) >= 10, "the table of rooms was not found in docs/architecture.md"
    assert broken(rooms, arrows(ROOT)) == []


def test_each_room_is_small_enough_to_find_your_way_in() -> None:
    """A newcomer picks a folder by the question they have and finds a few files there
    (STYLE.md): each folder of a room, its sub-folders counted on their own."""
    crowded = {
        str(folder.relative_to(ROOT / "workers")): count
        for folder in (ROOT / "workers").rglob("*")
        if folder.is_dir() and (folder / "__init__.py").exists()
        if (count := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES
    }
    assert crowded == {}


@pytest.mark.parametrize(
    ("files", "table", "words"),
    [
        (
            {
                "workers/a/__init__.py": "",
                "workers/a/x.py": "from workers.b import y\n",
                "workers/b.py": "",
            },
            "| 1 | `workers.a` | | |\n| 0 | `workers.b` | | |",
            "workers.a imports workers.b, which the table omits",
        ),
        (
            {"workers/a/__init__.py": "", "workers/a/x.py": "", "workers/b.py": ""},
            "| 1 | `workers.a` | | b |\n| 0 | `workers.b` | | |",
            "workers.a no longer imports workers.b",
        ),
        (
            {"workers/a.py": "import workers.b.z\n", "workers/b/__init__.py": ""},
            "| 0 | `workers.a` | | b |\n| 1 | `workers.b` | | |",
            "arrows go down",
        ),
        (
            {"workers/a.py": "from workers.b import f\n", "workers/b.py": "from . import a\n"},
            "| 1 | `workers.a` | | b |\n| 1 | `workers.b` | | a |",
            "arrows go down",
        ),
        ({"workers/a.py": "", "workers/c.py": ""}, "| 0 | `workers.a` | | |", "not in the table"),
    ],
)
def test_a_drawing_that_lies_is_found(
    tmp_path: Path, files: dict[str, str], table: str, words: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "workers" / "__init__.py").write_text("")
    problems = broken(drawn(table), arrows(tmp_path))
    assert any(words in line for line in problems), problems
