"""The worker's config file: TOML, keys named as the settings, below flags and variables.

``ConfigFileSource`` is the pydantic-settings source ``WorkerSettings`` reads last
(flags, then ``CONVEYOR_*`` variables, then this file, then defaults); the file is
the one ``config_file`` names in a higher source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsError,
)

from workers.config.host import host_file, load_toml


class ConfigFileSource(PydanticBaseSettingsSource):
    """The TOML file that ``config_file`` names, if a higher source names one.

    Keys are field names; nested settings are tables (``[limits]``). A missing or
    malformed file, or a key that is no setting, raises ``SettingsError`` naming
    the file: a misspelt key must not be silently ignored.
    """

    def __init__(
        self, settings_cls: type[BaseSettings], *naming: PydanticBaseSettingsSource
    ) -> None:
        super().__init__(settings_cls)
        self._naming = naming  # the sources that may name the file, highest first

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        named = self._named("config_file")
        if not named:
            return {}
        return read_config_file(
            Path(named), set(self.settings_cls.model_fields), self._named("host_model")
        )

    def _named(self, key: str) -> Any:
        """``key``'s value in the highest source that sets it, else None."""
        for source in self._naming:
            values = source.init_kwargs if isinstance(source, InitSettingsSource) else source()
            if values.get(key):
                return values[key]
        return None


def read_config_file(path: Path, fields: set[str], model: str | None = None) -> dict[str, Any]:
    """The settings in TOML file ``path``; raises ``SettingsError`` naming what is wrong.
    For a host file (``[[models]]``, ``workers.config.host``): its shared settings with
    ``model``'s table over them (the shared ones alone without ``model``)."""
    values = load_toml(path)
    host = host_file(values, path, fields)
    if host is not None:
        return {**host.shared, **host.model(model).table} if model else dict(host.shared)
    if model:
        raise SettingsError(f"config file {path}: --host-model {model} needs [[models]] tables")
    unknown = sorted(values.keys() - (fields - {"config_file", "host_model"}))
    if unknown:
        raise SettingsError(
            f"config file {path}: {', '.join(unknown)} "
            f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}; keys are "
            "the flag names with underscores (max_batch_size = 64)"
        )
    return values
