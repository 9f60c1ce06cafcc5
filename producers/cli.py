"""The ``conveyor`` command.

The client commands (submit, result, status, wait, cancel, topics, results, stream,
canary, compare, gateway) live in this package and need only the client install. Other
commands come from the packages that own them, through the entry-point group
``COMMANDS`` (``pyproject.toml``): ``conveyor worker`` is ``workers.cli``'s, so this package
never imports the worker. A command whose package is not installed, or cannot
be imported, says which extra to install. ``--kafka-bootstrap`` and
``--redis-url`` may come before the command or after it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points, version

from common.install import DISTRIBUTION, install_hint
from producers.commands import CONNECTION_OPTIONS, add_client_commands, connection_options
from producers.gateway.command import add_gateway_command
from producers.rebuild_command import add_results_commands
from producers.version_commands import add_version_commands
from producers.video import add_stream_command

COMMANDS = "conveyor_serve.commands"
"""Entry-point group of the commands other packages add, each a ``configure(parser)``."""
PLUGGED_IN = {"worker": ("consume a model's requests and serve them", "worker")}
"""Commands found through ``COMMANDS``: their help, and the extra that installs them."""
EXIT_NOT_INSTALLED = 5  # as workers.exits.EXIT_NOT_INSTALLED
_GLOBAL = "global_"  # dest prefix of the connection options given before the command

Configure = Callable[[argparse.ArgumentParser], None]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor", description="Serve PyTorch models from Kafka."
    )
    parser.add_argument("--version", action="version", version=f"conveyor {version(DISTRIBUTION)}")
    connection_options(parser, dest_prefix=_GLOBAL)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, extra) in PLUGGED_IN.items():
        command = commands.add_parser(name, help=help_text)
        try:
            configure = _plugged_in(name)
        except ImportError as exc:
            _not_installed(command, name, extra, str(exc))
        else:
            configure(command)
    connection = argparse.ArgumentParser(add_help=False)
    connection_options(connection)
    add_client_commands(commands, connection)
    add_results_commands(commands, connection)
    add_stream_command(commands, connection)
    add_version_commands(commands, connection)
    add_gateway_command(commands, connection)
    return parser


def _plugged_in(name: str) -> Configure:
    """The ``configure`` function registered for command ``name``; ``ImportError`` when no
    installed package registers it or its module does not import."""
    found = entry_points(group=COMMANDS, name=name)
    if not found:
        raise ImportError(f"no installed package provides `conveyor {name}`")
    configure: Configure = next(iter(found)).load()
    return configure


def _not_installed(command: argparse.ArgumentParser, name: str, extra: str, why: str) -> None:
    message = (
        f"conveyor {name}: needs the {extra} extra, which is not installed ({why}): "
        f"{install_hint(extra)}"
    )
    command.description = message
    command.set_defaults(handler=lambda _args: _fail(message), takes_any=True)


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_NOT_INSTALLED


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # A command that is not installed takes any arguments, so that it can say what to
    # install instead of refusing the options it would have had.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
