"""Where the compile cache lives."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.config.worker import WorkerSettings
from workers.model.compile_cache import cache_root


def test_a_relative_compile_cache_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inductor runs its C++ compiler in a folder of its own: a relative source path
    # there names nothing (a detector's CPU kernels failed to build that way).
    monkeypatch.chdir(tmp_path)
    settings = WorkerSettings.model_validate({"model": "digits", "compile_cache": ".run/cache"})
    assert cache_root(settings) == tmp_path / ".run" / "cache"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = WorkerSettings.model_validate({"model": "digits", "compile_cache": "~/c"})
    assert cache_root(home) == tmp_path / "home" / "c"


def test_the_default_compile_cache_follows_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = WorkerSettings.model_validate({"model": "digits"})
    assert cache_root(settings) == tmp_path / "conveyor-serve" / "compile"
