"""``conveyor canary`` and ``conveyor compare``: a new version beside the one callers get.

The command lines of ``producers.canary`` and ``producers.compare``, and the
comparison's report for people (``report``); errors and exit statuses as for the
other client commands (``producers.commands``).
docs/operations.md ("Changing the model") says when to use which.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import asdict

import orjson

from producers.canary import canary_status, set_canary_share
from producers.commands import EXIT_NOT_OK, EXIT_OK, runner
from producers.compare import IOU_MATCH, Agreement, Comparison, percentiles, read_comparison
from producers.errors import InvalidInput
from producers.settings import ClientSettings


def add_version_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: argparse.ArgumentParser,
) -> None:
    """Add ``canary`` and ``compare`` to ``commands``; ``connection`` holds the connection
    options."""
    canary = commands.add_parser(
        "canary",
        parents=[connection],
        help="give a model's canary workers a share of its requests, or show where it stands",
        description="With --share, write a canary marker to every partition of the model's "
        "request topics: from there on, the canary workers (conveyor worker --canary) answer "
        "that share of the requests, chosen by a hash of each request's stream or id, and the "
        "primary workers the rest. Requests sent before keep the share they were sent under. "
        "The first time, the canary group is placed at the markers (its workers start there, "
        "so set the share before starting them). --share 0 ends the canary once its workers "
        "have answered their share of what came before (see their lag here). Without --share, "
        "show each group's committed position on each request partition, the share in "
        "effect there and the records behind it.",
    )
    canary.add_argument("--model", required=True, help="model name")
    canary.add_argument(
        "--share",
        type=float,
        metavar="PERCENT",
        help="the canary's share of requests from now on, 0 to 100 (e.g. 10, 2.5)",
    )
    canary.set_defaults(handler=runner(_canary))

    compare = commands.add_parser(
        "compare",
        parents=[connection],
        help="compare a model's shadow results with what its callers got",
        description="Read the model's shadow results (conveyor.MODEL.shadow-results, written "
        "by conveyor worker --shadow) and its results topic, join them by request id, and "
        "report how far the two versions agree (status; top-1 class, box IoU or embedding "
        "cosine by task; identical outputs otherwise) and their latencies.",
    )
    compare.add_argument("--model", required=True, help="model name")
    compare.add_argument(
        "--version", help="only the shadow's results of this model_version (default: all)"
    )
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.set_defaults(handler=runner(_compare))


async def _canary(args: argparse.Namespace, settings: ClientSettings) -> int:
    if args.share is None:
        for position in await canary_status(settings, args.model):
            sys.stdout.write(orjson.dumps(asdict(position)).decode() + "\n")
        return EXIT_OK
    if not 0 <= args.share <= 100:
        raise InvalidInput(f"--share is a percentage from 0 to 100, not {args.share:g}")
    done = await set_canary_share(settings, args.model, args.share / 100)
    sys.stdout.write(orjson.dumps(asdict(done)).decode() + "\n")
    print(
        f"canary share of {args.model}: {done.share * 100:g}% of the requests after the "
        f"markers on {len(done.markers)} partitions"
        + (f"; the canary group starts at them on {len(done.placed)}" if done.placed else ""),
        file=sys.stderr,
    )
    if done.share and not done.canary_workers:
        print(
            f"no canary worker runs yet: its share waits in the topics until one does "
            f"(conveyor worker --model-name {args.model} --canary ...)",
            file=sys.stderr,
        )
    return EXIT_OK


async def _compare(args: argparse.Namespace, settings: ClientSettings) -> int:
    comparison, primary, shadow = await read_comparison(settings, args.model, args.version)
    if args.json:
        sys.stdout.write(orjson.dumps(comparison.document()).decode() + "\n")
    else:
        print(report(comparison, args.model, primary, shadow))
    return EXIT_OK if comparison.joined else EXIT_NOT_OK


def report(comparison: Comparison, model: str, primary_topic: str, shadow_topic: str) -> str:
    """The comparison for people: agreement first, then latency."""
    found = comparison
    lines = [
        f"{model}: {found.joined:,} requests answered by both",
        f"  primary  {primary_topic}: {_versions(found.primary_versions)}",
        f"  shadow   {shadow_topic}: {_versions(found.shadow_versions)}",
    ]
    if found.shadow_only:
        lines.append(
            f"  {found.shadow_only:,} answered by the shadow only (the primary's answer went "
            "to a ce_replyto topic, or is not there yet)"
        )
    lines.append(_line("same status", found.status))
    if found.top1.compared:
        lines.append(_line("top-1 class agrees", found.top1))
    boxes = found.boxes
    if boxes.compared:
        lines.append(
            f"  boxes matched (IoU >= {IOU_MATCH}, same class): {boxes.matched:,} of "
            f"{boxes.primary:,} primary and {boxes.shadow:,} shadow boxes "
            f"(F1 {_number(boxes.f1)}), mean IoU {_number(boxes.mean_iou)}"
        )
    if found.cosine.values:
        lines.append(
            f"  embedding cosine similarity: mean {_number(found.cosine.mean)}, "
            f"min {_number(min(found.cosine.values))} over {len(found.cosine.values):,}"
        )
    if found.identical.compared:
        lines.append(_line("identical outputs", found.identical))
    if found.latency_ms:
        lines.append("  latency (ms)               p50        p90        p99")
        for what in ("inference", "queue", "end_to_end"):
            for side in ("primary", "shadow"):
                values = percentiles(found.latency_ms.get(side, {}).get(what, []))
                cells = "".join(f"{_number(v, 1):>11}" for v in values.values())
                lines.append(f"    {side:<8} {what.replace('_', ' '):<13}{cells}")
    return "\n".join(lines)


def _line(what: str, agreement: Agreement) -> str:
    rate = agreement.rate
    percent = "-" if rate is None else f"{rate * 100:.2f}%"
    return f"  {what}: {agreement.agreed:,} of {agreement.compared:,} ({percent})"


def _versions(versions: Counter[str]) -> str:
    return ", ".join(f"{v} ({n:,})" for v, n in versions.most_common()) or "no results"


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
