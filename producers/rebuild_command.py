"""``conveyor results rebuild``: write a model's results back into Redis from its reply topic.

The command line of ``producers.rebuild``; errors and exit statuses as for the
other client commands (``producers.commands``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

import orjson

from producers.commands import EXIT_OK, runner
from producers.progress import ProgressBar
from producers.rebuild import rebuild_results
from producers.settings import ClientSettings


def add_results_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: argparse.ArgumentParser,
) -> None:
    """Add ``results rebuild`` to ``commands``; ``connection`` holds the connection options."""
    results = commands.add_parser("results", help="manage a model's results in Redis")
    result_commands = results.add_subparsers(dest="results_command", required=True)
    rebuild = result_commands.add_parser(
        "rebuild",
        parents=[connection],
        help="write a model's results from its reply topic back into Redis",
        description="Read the model's reply topic (conveyor.MODEL.results) from its start "
        "to its end as it is now, committed records only, and write every result Redis "
        "lacks the way a worker does (SET NX, then PUBLISH on the key's channel): the "
        "first result of each id wins, a result Redis holds is never replaced, and each "
        "keeps what is left of its time to live, counted from when its worker stored it "
        "(one whose time is up is skipped). Running it twice changes nothing. For a "
        "Redis that lost its data (restarted without persistence, failed over to an "
        "empty replica).",
    )
    rebuild.add_argument("--model", required=True, help="model name")
    rebuild.add_argument(
        "--ttl-s",
        type=int,
        default=86_400,
        help="the workers' --result-ttl-s: how long a result lives from its store time "
        "(default 86400)",
    )
    rebuild.add_argument(
        "--topic", help="read this reply topic instead (results sent with reply_to)"
    )
    rebuild.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on a terminal)",
    )
    rebuild.set_defaults(handler=runner(_results_rebuild))


async def _results_rebuild(args: argparse.Namespace, settings: ClientSettings) -> int:
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress: list[ProgressBar] = []

    def total(count: int) -> None:
        if show:
            progress.append(ProgressBar(count, "records", sys.stderr))

    def advance(count: int) -> None:
        for bar in progress:
            bar.advance(count)

    started = time.monotonic()
    try:
        report = await rebuild_results(
            settings, args.model, args.ttl_s, topic=args.topic, on_total=total, on_progress=advance
        )
    finally:
        for bar in progress:
            bar.close()
    document = asdict(report) | {"seconds": round(time.monotonic() - started, 3)}
    sys.stdout.write(orjson.dumps(document).decode() + "\n")
    return EXIT_OK
