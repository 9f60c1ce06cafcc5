"""The distribution as users get it: built, installed into a fresh environment, run.

- ``python -m build`` makes an sdist and, from it, a wheel; the wheel holds the
  five packages (every module, ``py.typed``), the license and the ``conveyor``
  command, and nothing else (no tests, no bench, no deployment files).
- ``pip install .`` into a fresh virtual environment (the client-only install:
  no extras, so no torch) imports the public package and runs ``conveyor --help``;
  ``conveyor worker`` there says in one line how to get the worker and exits
  with its documented status.

Both need PyPI or pip's cache for the build backend and the client's dependencies.
The sources are copied first, so a build never writes into the checkout.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import common
import demo
import producers
import schemas
import workers
from common.install import DISTRIBUTION
from workers.exits import EXIT_NOT_INSTALLED

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (schemas, common, workers, producers, demo)
PUBLIC_PACKAGE = producers  # the SDK: what a client-only install is for

# One test process runs them all under pytest -n: the sdist and wheel are built once.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("install")]


def _run(argv: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=540)
    if check:
        assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files git would commit (tracked, or new and not ignored), copied."""
    copy = tmp_path_factory.mktemp("source") / "conveyor"
    listed = _run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT
    ).stdout
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # a file deleted but not yet committed is skipped
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def built(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel), the wheel built from the sdist as ``python -m build`` does."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), "."], cwd=source)
    [sdist] = out.glob("*.tar.gz")
    [wheel] = out.glob("*.whl")
    return sdist, wheel


def _package_dir(module: object) -> str:
    return str(getattr(module, "__name__", "")).replace(".", "/")


def test_the_name_everywhere_is_the_distribution_name(built: tuple[Path, Path]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    _sdist, wheel = built
    assert wheel.name.startswith(DISTRIBUTION.replace("-", "_") + "-")


def test_wheel_holds_the_packages_license_and_command_only(built: tuple[Path, Path]) -> None:
    _sdist, wheel = built
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [info] = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    packages = [_package_dir(p) for p in PACKAGES]
    outside = [
        n
        for n in names
        if not n.startswith(info) and not any(n.startswith(p + "/") for p in packages)
    ]
    assert not outside, f"files outside the packages: {outside}"
    for module, folder in zip(PACKAGES, packages, strict=True):
        source_dir = Path(str(module.__file__)).parent
        expected = {f"{folder}/{p.name}" for p in source_dir.glob("*.py")} | {f"{folder}/py.typed"}
        assert expected <= set(names), f"missing from the wheel: {sorted(expected - set(names))}"
    assert metadata["Name"] == DISTRIBUTION
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
    assert f"conveyor = {PUBLIC_PACKAGE.__name__}.cli:main" in entry_points
    # `conveyor worker`, found by the client package without importing the worker.
    assert "[conveyor_serve.commands]\nworker = workers.cli:configure" in entry_points
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"worker", "video", "dev"} <= extras


def test_sdist_has_what_the_wheel_is_built_from(built: tuple[Path, Path]) -> None:
    import tarfile

    sdist, _wheel = built
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "LICENSE"} <= names
    assert not {n for n in names if n.startswith((".venv/", ".cache/", ".run/"))}


@pytest.fixture(scope="module")
def client_venv(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with ``pip install .``: no extras."""
    venv = tmp_path_factory.mktemp("client") / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=source)
    _run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "."], cwd=source)
    return venv / "bin"


def test_client_install_imports_and_runs_without_torch(client_venv: Path, tmp_path: Path) -> None:
    python = str(client_venv / "python")
    probe = (
        f"import importlib.util, {PUBLIC_PACKAGE.__name__} as sdk; "
        "print(sdk.Client.__name__, importlib.util.find_spec('torch') is None)"
    )
    # From a folder of its own, so nothing of the checkout is importable.
    assert _run([python, "-c", probe], cwd=tmp_path).stdout.split() == ["Client", "True"]
    help_text = _run([str(client_venv / "conveyor"), "--help"], cwd=tmp_path).stdout
    for command in ("worker", "submit", "result", "wait", "topics", "stream"):
        assert command in help_text
    version = _run([str(client_venv / "conveyor"), "--version"], cwd=tmp_path).stdout
    assert (
        version.strip()
        == f"conveyor {tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['version']}"
    )


def test_worker_on_a_client_install_says_what_to_install(client_venv: Path, tmp_path: Path) -> None:
    conveyor = str(client_venv / "conveyor")
    assert "batching:" in _run([conveyor, "worker", "--help"], cwd=tmp_path).stdout
    done = _run([conveyor, "worker", "--model", "digits"], cwd=tmp_path, check=False)
    assert done.returncode == EXIT_NOT_INSTALLED
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("conveyor worker: needs the worker extra")
    assert line.endswith(f"pip install '{DISTRIBUTION}[worker]'")
