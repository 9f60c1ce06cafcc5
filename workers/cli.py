"""``conveyor worker``: flags and CONVEYOR_* variables → WorkerSettings → the worker process.

Flags are generated from WorkerSettings' fields, so a field, its flag
(``--max-batch-size``) and its variable (``CONVEYOR_MAX_BATCH_SIZE``) never drift
apart. A flag given on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import Any, get_args

from pydantic import SecretStr, ValidationError

from producers.security import ConnectFailed
from workers.logs import configure_logging
from workers.settings import WorkerSettings

_EXIT_CONFIG = 3  # topics missing or access refused: retrying does not help
_EXIT_UNREACHABLE = 4  # as the client commands' EXIT_UNAVAILABLE
_SKIPPED = {"limits"}  # nested: set through CONVEYOR_LIMITS__<FIELD> variables


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, info in WorkerSettings.model_fields.items():
        if name in _SKIPPED:
            continue
        flag = "--" + name.replace("_", "-")
        env = f"CONVEYOR_{name.upper()}"
        help_text = f"{info.description or name.replace('_', ' ')} [env {env}]"
        if info.annotation in (bool, bool | None):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            choices = get_args(info.annotation) if "Literal" in str(info.annotation) else None
            parser.add_argument(
                flag, default=None, choices=choices or None, help=help_text, metavar=name.upper()
            )


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    given: dict[str, Any] = {
        name: value
        for name, value in vars(args).items()
        if name in WorkerSettings.model_fields and value is not None
    }
    if "redis_url" in given:
        given["redis_url"] = SecretStr(given["redis_url"])
    return WorkerSettings(**given)


def describe_error(exc: ValidationError) -> str:
    lines = ["invalid worker settings:"]
    for err in exc.errors():
        name = ".".join(str(part) for part in err["loc"]) or "settings"
        flag = "--" + name.replace("_", "-")
        env = "CONVEYOR_" + name.upper().replace(".", "__")
        lines.append(f"  {name} ({flag} or {env}): {err['msg']}")
    return "\n".join(lines)


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when asked for, or for ``auto`` when installed; None: asyncio's."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError(
                "event_loop uvloop needs the uvloop package: pip install uvloop"
            ) from None
        return None
    return uvloop.new_event_loop


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"conveyor worker: {describe_error(exc)}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)

    from workers.app import run_worker  # torch is imported only when a worker really starts
    from workers.types import ConfigError

    try:
        with asyncio.Runner(loop_factory=_loop_factory(settings.event_loop)) as runner:
            runner.run(run_worker(settings))
    except (ValueError, FileNotFoundError) as exc:
        print(f"conveyor worker: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # a missing topic, a refused ACL: an operator must act
        print(f"conveyor worker: {exc}", file=sys.stderr)
        return _EXIT_CONFIG
    except ConnectFailed as exc:  # unreachable, or TLS or credentials refused: retrying won't help
        print(f"conveyor worker: {exc}", file=sys.stderr)
        return _EXIT_UNREACHABLE
    return 0
