"""The worker's config file: TOML, keys named as the settings, below flags and variables.

``ConfigFileSource`` is the pydantic-settings source ``WorkerSettings`` reads last
(flags, then ``CONVEYOR_*`` variables, then this file, then defaults); the file is
the one ``config_file`` names in a higher source.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsError,
)


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
        for source in self._naming:
            named = (
                source.init_kwargs if isinstance(source, InitSettingsSource) else source()
            ).get("config_file")
            if named:
                return read_config_file(Path(named), set(self.settings_cls.model_fields))
        return {}


def read_config_file(path: Path, fields: set[str]) -> dict[str, Any]:
    """The settings in TOML file ``path``; raises ``SettingsError`` naming what is wrong."""
    try:
        with path.open("rb") as file:
            values = tomllib.load(file)
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(values.keys() - (fields - {"config_file"}))
    if unknown:
        raise SettingsError(
            f"config file {path}: {', '.join(unknown)} "
            f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}; keys are "
            "the flag names with underscores (max_batch_size = 64)"
        )
    return values
