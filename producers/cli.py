"""The ``conveyor`` command.

Client commands (submit, result, wait, topics; in ``producers.commands``) need
only the client install; ``conveyor worker`` needs the ``worker`` extra
(torch), which is imported only when that command runs. ``--kafka-bootstrap``
and ``--redis-url`` may come before the command or after it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module
from importlib.metadata import version

from producers.commands import CONNECTION_OPTIONS, add_client_commands, connection_options
from producers.install import DISTRIBUTION, install_hint
from producers.video import add_stream_command

EXIT_WORKER_NOT_INSTALLED = 5  # as workers.cli.EXIT_NOT_INSTALLED, which may not import
_GLOBAL = "global_"  # dest prefix of the connection options given before the command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor", description="Serve PyTorch models from Kafka."
    )
    parser.add_argument("--version", action="version", version=f"conveyor {version(DISTRIBUTION)}")
    connection_options(parser, dest_prefix=_GLOBAL)
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("worker", help="consume a model's requests and serve them")
    try:
        worker_cli = import_module("workers.cli")
    except ImportError as exc:  # a client-only install: say how to get the worker
        worker.set_defaults(handler=lambda _args, exc=exc: _missing_worker(exc))
    else:
        worker_cli.add_arguments(worker)
        worker.set_defaults(handler=worker_cli.run)
    connection = argparse.ArgumentParser(add_help=False)
    connection_options(connection)
    add_client_commands(commands, connection)
    add_stream_command(commands, connection)
    return parser


def _missing_worker(exc: ImportError) -> int:
    print(
        f"conveyor worker: needs the worker extra, which is not installed ({exc}): "
        f"{install_hint('worker')}",
        file=sys.stderr,
    )
    return EXIT_WORKER_NOT_INSTALLED


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _apply_global_options(args)
    status: int = args.handler(args)
    return status


def _apply_global_options(args: argparse.Namespace) -> None:
    """A connection option given before the command counts unless the command has its own.

    (argparse lets a subcommand's defaults overwrite the main parser's values,
    so the two are parsed under different names and merged here.)
    """
    for name in CONNECTION_OPTIONS:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(args, _GLOBAL + name))


if __name__ == "__main__":
    sys.exit(main())
