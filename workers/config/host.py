"""The host file: one ``conveyor worker`` for several models, one ``[[models]]`` table each.

A config file (``--config-file``) with ``[[models]]`` tables describes a host rather than
one worker. Its top-level keys are settings every model shares (the broker, Redis, the
cards, the metrics port); each table holds one model's own (``model`` and what else it
sets: ``model_name``, ``weights``, ``max_batch_size``, ``processes``, ``gpus`` ...), and
wins over the top level for that model. A process of the host serves one model: the
supervisor starts it with ``--host-model NAME``, and it reads the top level and that
table (``workers.config.file``), so a process started again after SIGHUP reads the file
as it is then.

Pure rules, no I/O but reading the file: the models (``read_host_file``), each one's
name (``model_name_of``), and what a reload does (``reload_plan``; ``reload_from`` for
a running host, known by its ``fingerprint``).
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic_settings import SettingsError

MODELS_KEY = "models"
"""The array of tables, one a model."""
HOST_FILE_PATH = "/host-file"
"""Where a running host serves its file's ``fingerprint``, on its metrics port."""

_HOST_ONLY = frozenset({"config_file", "host_model"})
_SIZE_KEYS = ("processes", "gpus")  # what a model's processes and cards are planned from


@dataclass(frozen=True)
class HostModel:
    """One ``[[models]]`` table: the model's name in topic names and its own settings."""

    name: str
    table: Mapping[str, Any]


@dataclass(frozen=True)
class HostFile:
    """A host file's shared settings (its top level) and its models, in file order."""

    shared: Mapping[str, Any]
    models: tuple[HostModel, ...]

    def model(self, name: str) -> HostModel:
        """The model named ``name``; raises ``SettingsError`` listing the file's."""
        for model in self.models:
            if model.name == name:
                return model
        names = ", ".join(m.name for m in self.models)
        raise SettingsError(f"host file: no model named {name!r} (it has {names})")


@dataclass(frozen=True)
class Reload:
    """What SIGHUP does to a host's models: names, in file order."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    resized: list[str] = field(default_factory=list)
    """Of ``changed``, the models whose process count or cards may change: drained and
    started anew with their new processes (when the count or cards do change)."""

    def describe(self) -> str:
        rolled = [name for name in self.changed if name not in self.resized]
        parts = [
            f"{what} {', '.join(names)}"
            for what, names in (
                ("start", self.added),
                ("drain and stop", self.removed),
                ("restart one process a card at a time", rolled),
                ("drain, then start with the new process count or cards", self.resized),
                ("leave alone", self.unchanged),
            )
            if names
        ]
        return "; ".join(parts) or "nothing to do"


def model_name_of(table: Mapping[str, Any]) -> str:
    """A table's name in topic names: ``model_name``, else the last part of ``model``
    (as ``WorkerSettings.served_name`` derives it)."""
    if table.get("model_name"):
        return str(table["model_name"])
    spec = str(table["model"])
    tail = re.split(r"[:/]", spec)[-1]
    return re.sub(r"\.(pt2?|pth|ts)$", "", tail) or spec


def host_file(values: Mapping[str, Any], path: Path, fields: set[str]) -> HostFile | None:
    """The host ``values`` (a config file's, read) describe, or None when it has no
    ``[[models]]``. Raises ``SettingsError`` naming what is wrong."""
    if MODELS_KEY not in values:
        return None
    tables = values[MODELS_KEY]
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise SettingsError(
            f"config file {path}: {MODELS_KEY} must be [[{MODELS_KEY}]] tables, one a model"
        )
    shared = {k: v for k, v in values.items() if k != MODELS_KEY}
    if "model" in shared or "model_name" in shared:
        raise SettingsError(
            f"config file {path}: a file with [[{MODELS_KEY}]] names each model in its table; "
            "move model (and model_name) into the tables"
        )
    models: list[HostModel] = []
    for number, table in enumerate(tables, start=1):
        where = f"config file {path}, [[{MODELS_KEY}]] table {number}"
        if "model" not in table:
            raise SettingsError(f'{where}: model is missing (model = "torchvision:resnet50")')
        unknown = sorted(table.keys() - (fields - _HOST_ONLY))
        if unknown:
            raise SettingsError(
                f"{where}: {', '.join(unknown)} "
                f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}"
            )
        name = model_name_of(table)
        if any(model.name == name for model in models):
            raise SettingsError(
                f"{where}: a second model named {name!r}; give one of them its own model_name"
            )
        models.append(HostModel(name, table))
    return HostFile(shared, tuple(models))


def read_host_file(path: Path, fields: set[str]) -> HostFile | None:
    """The host file at ``path``, or None when it is a plain config file (no
    ``[[models]]``). Raises ``SettingsError`` naming what is wrong."""
    return host_file(load_toml(path), path, fields)


def load_toml(path: Path) -> dict[str, Any]:
    """A config file's values; raises ``SettingsError`` naming the file and the fault."""
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None


def reload_plan(before: HostFile, after: HostFile, running: Sequence[str] | None = None) -> Reload:
    """What a reload from ``before`` to ``after`` does. A change of the shared settings
    changes every model; ``running`` (default: ``before``'s models) are the ones the host
    runs now."""
    names = list(running) if running is not None else [m.name for m in before.models]
    return reload_from(fingerprint(before, names), after)


def fingerprint(file: HostFile, running: Sequence[str]) -> dict[str, Any]:
    """What a reload needs to know of the file a host runs, and no value that could be a
    secret: a digest of its shared settings and of each model's table, each model's
    process count and cards, and the models it runs (``running``). JSON, so that
    ``--check`` can read it from a running host (``/host-file``)."""
    return {
        "shared": _digest(file.shared),
        "models": {
            m.name: {
                "table": _digest(m.table),
                **{key: m.table.get(key, file.shared.get(key)) for key in _SIZE_KEYS},
            }
            for m in file.models
        },
        "running": list(running),
    }


def reload_from(running: Mapping[str, Any], after: HostFile) -> Reload:
    """What a reload to ``after`` does to the host whose ``fingerprint`` is ``running``."""
    old: Mapping[str, Mapping[str, Any]] = running["models"]
    new = fingerprint(after, [])["models"]
    shared_changed = running["shared"] != _digest(after.shared)
    plan = Reload()
    for name, now in new.items():
        if name not in running["running"]:
            plan.added.append(name)
        elif shared_changed or old.get(name, {}).get("table") != now["table"]:
            plan.changed.append(name)
            was = old.get(name, {})
            if any(was.get(key) != now.get(key) for key in _SIZE_KEYS):
                plan.resized.append(name)
        else:
            plan.unchanged.append(name)
    plan.removed.extend(name for name in running["running"] if name not in new)
    return plan


def _digest(values: Mapping[str, Any]) -> str:
    text = json.dumps(values, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
