"""The one command per host as the end-to-end stages run it, and the stages about the host.

``conveyor worker`` (a supervisor and its processes) in layouts ``PROCESSESxCARDS``
(``auto``: the count the command chooses), started on the workers' cores with
``--pin``, and a wait for every result of a load; the ``ready`` stage (seconds to
ready, cold and warm compile cache) and the ``kill`` stage (a process SIGKILLed
mid-backlog, lost and duplicate-visible counted).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.cores import _cores, _worker_cores
from bench.gpu.corpus import Corpus
from bench.gpu.load import _produce_parallel
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    WorkerConfig,
    WorkerProcess,
    await_results,
    read_results,
    tally,
    unless_one_exits,
    until,
    until_all_ready,
    until_answered,
)
from schemas import Result, topics_for
from workers.fleet import plan


def parse_layout(layout: str) -> tuple[int | None, int]:
    """``PxG``: P processes a card (``auto``: the command's own choice) on G cards."""
    per_card, _, gpus = layout.lower().partition("x")
    if not gpus.isdigit() or not (per_card == "auto" or per_card.isdigit()):
        raise SystemExit(f"layout {layout!r}: write PROCESSESxCARDS, e.g. autox1, 8x2")
    return (None if per_card == "auto" else int(per_card)), int(gpus)


def expected_processes(per_card: int | None, gpus: int, args: argparse.Namespace) -> int:
    """How many processes the one command will run for a layout: what ``processes auto``
    decides from the cores it may use (the workers' ones with ``--pin``) and the cards."""
    if per_card is not None:
        return per_card * max(gpus, 1)
    if gpus == 0:
        return 1
    cores = len(_worker_cores(args)) if args.pin else len(_cores())
    return plan.per_card(None, gpus, cores) * gpus


def layout_name(per_card: int | None, gpus: int) -> str:
    return f"{'auto' if per_card is None else per_card}x{gpus}"


async def _await_results(
    prefix: str, count: int, args: argparse.Namespace, workers: Sequence[WorkerProcess]
) -> list[Result]:
    """Every result of the requests ``<prefix>-0`` to ``<prefix>-<count - 1>``, all ``ok``;
    ``RuntimeError`` otherwise, or as soon as a worker exits."""
    ids = [f"{prefix}-{n}" for n in range(count)]
    watch = ids[-args.producers :]  # each producer's last request
    await unless_one_exits(
        workers, await_results(args.redis_url, ids, args.e2e_timeout, watch=watch)
    )
    results = list((await read_results(args.redis_url, ids)).values())
    bad = [r for r in results if r.status.value != "ok"]
    if len(results) != count or bad:
        raise RuntimeError(f"{len(results)} of {count} results, {len(bad)} not ok: {bad[:1]}")
    return results


def _fleet(cfg: Config, model: str, args: argparse.Namespace) -> Fleet:
    """The one command of a layout (``_start_host`` starts it); its log in ``--out``.

    Only what a user with no weights file must say, and what the bench needs of its
    ports: every tuning is the command's default (``--profile``, ``--worker-decode`` and
    ``--worker-options`` change them)."""
    options = ("--weights", "random", "--metrics-host", "127.0.0.1", "--result-ttl-s", "3600")
    config = WorkerConfig(
        model, args.kafka_bootstrap, args.redis_url, model=cfg.model, options=options
    )
    return Fleet(config, args.out / "workers" / model)


def max_delay_ms_of(argv: Sequence[str]) -> float:
    """The ``max_delay_ms`` a ``conveyor worker`` command runs with: its flags (and the
    ``CONVEYOR_*`` variables) through the worker's own parser and settings, then its
    profile's value for what they leave unset, as the worker resolves them."""
    from workers.cli import add_arguments, settings_from_args
    from workers.config.profiles import tuned

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, expert=True)
    args, _ = parser.parse_known_args(list(argv))
    settings = tuned(settings_from_args(args), cuda=False, fixed_size_images=False)
    return float(settings.max_delay_ms)


def _start_host(
    fleet: Fleet, cfg: Config, args: argparse.Namespace, per_card: int | None, gpus: int
) -> WorkerProcess:
    """``conveyor worker`` for ``per_card`` processes a card on the first ``gpus`` cards;
    with ``--pin`` it starts on the workers' cores, and its processes inherit them."""
    flags: list[str] = []
    if cfg.device.type == "cuda":
        flags += ["--gpus", ",".join(str(n) for n in range(gpus))]
    if per_card is not None:
        flags += ["--processes", str(per_card * max(gpus, 1))]
    if args.profile != "throughput":
        flags += ["--profile", args.profile]
    if args.worker_decode != "auto":
        flags += ["--decode", args.worker_decode]
    if args.mps != "auto":
        flags += ["--mps", args.mps]
    if args.compile_cache is not None:
        flags += ["--compile-cache", str(args.compile_cache)]
    flags += shlex.split(args.worker_options)
    device = "cuda" if cfg.device.type == "cuda" else "cpu"
    mine = os.sched_getaffinity(0)
    if args.pin:
        os.sched_setaffinity(0, _worker_cores(args))  # the command inherits it, then its children
    try:
        return fleet.start(*flags, device=device, metrics_port=args.metrics_port)
    finally:
        os.sched_setaffinity(0, mine)


# -- time to ready: cold and warm compile cache -----------------------------------------------


def stage_ready(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """For each count of ``--ready-processes`` on one card: the one command started with an
    empty compile cache (cold: its first process compiles), stopped, started again on
    the same cache (warm); seconds from start to the host's /readyz 200. With several
    processes, also: one of them SIGKILLed on the warm host, seconds to ready again
    (``restart``: forked by the host's fork server), and a single process (no supervisor)
    on the same cache (``1x1 warm, alone``)."""
    return asyncio.run(_ready_rows(cfg, args))


async def _ready_rows(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    rows: dict[str, Any] = {}
    for text in args.ready_processes.split(","):
        per_card = None if text.strip() == "auto" else int(text)
        processes = expected_processes(per_card, 1, args)
        model = f"gpuready{processes}r{uuid.uuid4().hex[:8]}"
        await create_model_topics(settings, model, processes)
        cache = Path(tempfile.mkdtemp(prefix="conveyor-compile-"))
        timed = argparse.Namespace(**{**vars(args), "compile_cache": cache})
        starts = ["cold", "warm"] + (["alone"] if processes > 1 else [])
        try:
            for start in starts:
                async with _fleet(cfg, model, timed) as fleet:
                    started = time.monotonic()
                    host = _start_host(fleet, cfg, timed, 1 if start == "alone" else per_card, 1)
                    await until_all_ready([host], args.ready_timeout)
                    seconds = time.monotonic() - started
                    label = "1x1 warm, alone" if start == "alone" else f"{text.strip()}x1 {start}"
                    _ready_row(rows, label, 1 if start == "alone" else processes, seconds)
                    if start == "warm" and processes > 1:
                        restart = await _restart_one(host, args)
                        _ready_row(rows, f"{text.strip()}x1 restart", processes, restart)
        finally:
            await delete_model_topics(settings, model)
            shutil.rmtree(cache, ignore_errors=True)
    return rows


def _ready_row(rows: dict[str, Any], label: str, processes: int, seconds: float) -> None:
    rows[label] = {"processes": processes, "ready_s": seconds}
    print(f"  ready {label} ({processes} processes): {seconds:.1f} s", flush=True)


async def _restart_one(host: WorkerProcess, args: argparse.Namespace) -> float:
    """Seconds from one process's SIGKILL to the host's /readyz 200 again (the
    supervisor's first backoff, 1 s, included)."""
    victim = host.children()[0]
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)

    async def unready() -> bool:
        return not await host.ready()

    await until(unready, "the host unready once a process is killed", 30, host.log, [host])
    await until_all_ready([host], args.ready_timeout)
    return time.monotonic() - started


# -- the kill test: a GPU worker SIGKILLed mid-run loses nothing ----------------------------


def stage_kill(cfg: Config, corpora: Sequence[Corpus], args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_kill_one(cfg, corpora[0], args))


async def _kill_one(cfg: Config, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    """The one command with two processes on a card (under its MPS server), one of them
    SIGKILLed once a third of a backlog is answered: the supervisor starts it again and
    every request is answered once in Redis, the reply topic agreeing with it (lost 0,
    duplicate-visible 0, counted as the fault tests count: ``producers.testing.tally``)."""
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    model = f"gpukill{run}"
    partitions = 2
    await create_model_topics(settings, model, partitions)
    count = cfg.e2e_count
    prefix = f"{run}-k"
    ids = [f"{prefix}-{n}" for n in range(count)]
    await _produce_parallel(args, model, corpus, prefix, count, partitions)
    try:
        async with _fleet(cfg, model, args) as fleet:
            host = _start_host(fleet, cfg, args, 2, 1)
            await until_all_ready([host], args.ready_timeout)
            # Every 7th of the first third keeps the poll cheap while the GPU works.
            await host.unless_it_dies(
                until_answered(args.redis_url, ids[: count // 3 : 7], count // 21)
            )
            victims = host.children()
            if victims:
                os.kill(victims[0], signal.SIGKILL)
            await _await_results(prefix, count, args, [host])
            await until_all_ready([host], args.ready_timeout)  # the killed one is back
            log = host.log()
        counted = await tally(args.kafka_bootstrap, args.redis_url, topics_for(model).results, ids)
    finally:
        await delete_model_topics(settings, model)
    row = dataclasses.asdict(counted) | {
        "processes": 2,
        "killed": bool(victims),
        "started_again": "starting it again" in log,
    }
    print(f"  kill: {json.dumps(row)}", flush=True)
    return row
