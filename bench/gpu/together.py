"""The ``together`` stage: two models served by one command on one card, each alone and
both at once, in the same call (``docs/operations.md``, "Several models on one host").

For the two specs of ``--together`` (random weights: throughput only), ``conveyor
worker --config-file host.toml --gpus 0`` with a host file of one model, then of the
other, each given a backlog alone (its rate: A, B); then the host file of both, each
given a backlog at once (visible at the same moment), each model's rate counted over
the time both were answered (a, b). Time-sharing the card perfectly would give
``a/A + b/B = 1``; the bar is 0.9. Where one model's answers all come before the
other's (no such window: the card was not shared but taken in turn), the verdict is
the whole run's: the seconds the two backlogs take one after the other at their rates
alone over the seconds they took together. Each backlog is sized from the rate alone
to last ``--together-s``.

Last, the same two models with the second asking for ``--together-refused``
processes, more than the card holds: the host starts, refuses that model at start
with the numbers (its log line is kept), and serves the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.cores import _pin_services
from bench.gpu.corpus import Corpus
from bench.gpu.e2e import UtilizationSampler, _steady_state
from bench.gpu.host import _await_results, _start_host
from bench.gpu.load import produce_at_once
from bench.stats import durable_ms
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerConfig, WorkerProcess, until, until_all_ready
from producers.testing.net import http_get
from schemas import Result

TOGETHER = "torchvision:resnet50,timm:vit_base_patch16_224"
_PARTITIONS = 8
_BAR = 0.9


def stage_together(
    cfg: Config, corpora: Sequence[Corpus], args: argparse.Namespace
) -> dict[str, Any]:
    _pin_services(args)
    corpus = next(c for c in corpora if c.name == "224x224")
    return asyncio.run(_together(cfg, corpus, args))


async def _together(cfg: Config, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    specs = [s.strip() for s in args.together.split(",") if s.strip()]
    if len(specs) != 2:
        raise SystemExit(f"--together: two model specs, not {specs}")
    run = uuid.uuid4().hex[:6]
    names = [f"gputog{n}r{run}" for n in range(2)]
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    for name in names:
        await create_model_topics(settings, name, _PARTITIONS)
    out: dict[str, Any] = {"models": dict(zip(names, specs, strict=True))}
    try:
        alone = []
        for name, spec in zip(names, specs, strict=True):
            row = await _serve(cfg, corpus, args, f"alone-{name}", {name: spec}, None)
            out[f"{spec} alone"] = row
            alone.append(row["rates"][name])
            _say(out, f"{spec} alone")
        both = dict(zip(names, specs, strict=True))
        row = await _serve(cfg, corpus, args, "together", both, alone)
        _shares(row, names, alone)
        out["together"] = row
        _say(out, "together")
        if cfg.device.type == "cuda":  # the CPU has no memory plan: nothing is refused
            out["refused"] = await _refused(cfg, args, both, run)
            _say(out, "refused")
    finally:
        for name in names:
            await delete_model_topics(settings, name)
    return out


def _say(out: dict[str, Any], key: str) -> None:
    print(f"  together {key}: {json.dumps(out[key], default=str)}", flush=True)


def _host_file(folder: Path, label: str, models: dict[str, str], processes: int | None) -> Path:
    """A host file serving ``models`` (topic name -> spec), random weights; the last
    model asks for ``processes`` when given."""
    lines = []
    for n, (name, spec) in enumerate(models.items()):
        lines += ["[[models]]", f'model = "{spec}"', f'model_name = "{name}"', 'weights = "random"']
        if processes is not None and n == len(models) - 1:
            lines.append(f'processes = "{processes}"')
        lines.append("")
    path = folder / f"host-{label}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def _fleet(args: argparse.Namespace, host_file: Path, label: str) -> Fleet:
    options = ("--config-file", str(host_file), "--metrics-host", "127.0.0.1")
    config = WorkerConfig(label, args.kafka_bootstrap, args.redis_url, model="", options=options)
    return Fleet(config, args.out / "workers" / label)


async def _serve(
    cfg: Config,
    corpus: Corpus,
    args: argparse.Namespace,
    label: str,
    models: dict[str, str],
    alone: list[float] | None,
) -> dict[str, Any]:
    """One host of ``models``: ready time, then a backlog for each at once, sized to
    last ``--together-s`` at the rate each had alone (``alone``; a first guess when
    None), each model's rate over the time both were answered."""
    path = _host_file(args.out / "hosts", label, models, None)
    fleet = _fleet(args, path, label)
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, args, None, 1)
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        ready_s = time.monotonic() - started
        guesses = alone or [cfg.e2e_count / args.together_s] * len(models)
        counts = [max(2048, math.ceil(rate * args.together_s)) for rate in guesses]
        prefixes = [f"{label}-{name}" for name in models]
        with UtilizationSampler(1) as gpu:
            backlogs = list(zip(models, prefixes, counts, strict=True))
            await produce_at_once(args, corpus, backlogs, _PARTITIONS)  # visible at once
            results = await asyncio.gather(
                *(
                    _await_results(prefix, count, args, [host])
                    for prefix, count in zip(prefixes, counts, strict=True)
                )
            )
        row: dict[str, Any] = {
            "ready_s": round(ready_s, 1),
            "processes": len(host.children()),
            "counts": dict(zip(models, counts, strict=True)),
            "command": " ".join(host.config.argv()[3:]),
            "host_file": path.read_text(),
        }
        if len(models) == 1:
            steady = _steady_state(results[0], gpu)
            row["rates"] = {next(iter(models)): steady["img_s"]}
            row["gpu_util_pct"] = steady["gpu_util_pct"]
        else:
            row |= _overlap(list(models), results, gpu)
        return row
    finally:
        (args.out / f"together-{label}.log").write_text(fleet.logs())
        await fleet.aclose()


def _overlap(
    names: list[str], results: Sequence[Sequence[Result]], gpu: UtilizationSampler
) -> dict[str, Any]:
    """When each model's answers came (seconds from the first answer of any), and each
    one's rate over the window all were being answered: from the latest of their
    10th-percentile durable times to the earliest of their 90th (none when one model's
    answers all came before another's)."""
    times = [sorted(durable_ms(r) for r in rs) for rs in results]
    start = min(t[0] for t in times)
    spans = {
        name: [round((t[0] - start) / 1000.0, 2), round((t[-1] - start) / 1000.0, 2)]
        for name, t in zip(names, times, strict=True)
    }
    row: dict[str, Any] = {"answered_s": spans, "seconds": max(s[1] for s in spans.values())}
    low = max(t[len(t) // 10] for t in times)
    high = min(t[(len(t) * 9) // 10] for t in times)
    if high > low:
        seconds = (high - low) / 1000.0
        row["overlap_s"] = round(seconds, 2)
        row["rates"] = {
            name: sum(1 for x in t if low <= x <= high) / seconds
            for name, t in zip(names, times, strict=True)
        }
        row["gpu_util_pct"] = gpu.mean_between(low / 1000.0, high / 1000.0)
    return row


def _shares(row: dict[str, Any], names: list[str], alone: list[float]) -> None:
    """The verdict, in place: each model's rate together over its rate alone, summed
    (``a/A + b/B``: 1 is perfect time-sharing) over the window both were answered; and
    the same over the whole run, which needs no such window: the seconds the backlogs
    would take one after the other at their rates alone, over the seconds they took
    together, first answer to last (ramp and drain included)."""
    if "rates" in row:
        row["sum_of_shares"] = sum(row["rates"][n] / a for n, a in zip(names, alone, strict=True))
    apart = sum(row["counts"][n] / a for n, a in zip(names, alone, strict=True))
    row["whole_run_share"] = apart / row["seconds"] if row["seconds"] > 0 else math.nan
    verdict = row.get("sum_of_shares", row["whole_run_share"])
    row["bar"] = _BAR
    row["passed"] = verdict >= _BAR


async def _refused(
    cfg: Config, args: argparse.Namespace, models: dict[str, str], run: str
) -> dict[str, Any]:
    """The two models, the last asking for more processes than the card holds: the host
    serves the first and refuses the last at start, saying why."""
    label = f"refused-{run}"
    # The last model under a name of its own, whose requests topic has a partition for
    # every process asked: what refuses it is the card's memory, not the partitions.
    first, spec = next(iter(models.items())), list(models.values())[-1]
    last = f"gputogxr{run}"
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    await create_model_topics(settings, last, args.together_refused)
    path = _host_file(args.out / "hosts", label, dict([first, (last, spec)]), args.together_refused)
    fleet = _fleet(args, path, label)
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, args, None, 1)

        async def said() -> bool:
            return "does not fit on its cards" in host.log()

        async def serves() -> bool:  # the host's /readyz stays 503: one model is left out
            return (await _readyz(host, first[0]))[0] == 200

        await until(said, "the model refused", args.ready_timeout, host.log, [host])
        await until(serves, "the other model ready", args.ready_timeout, host.log, [host])
        line = next(x for x in host.log().splitlines() if "does not fit on its cards" in x)
        scoped = await _readyz(host, last)
        return {
            "seconds": round(time.monotonic() - started, 1),
            "processes_asked": args.together_refused,
            "log": line.strip()[-600:],
            "readyz_model": scoped,
            "readyz_host": (await _readyz(host, ""))[0],
            "passed": "MiB" in line and scoped[0] == 503,
        }
    finally:
        (args.out / f"together-{label}.log").write_text(fleet.logs())
        await fleet.aclose()
        await delete_model_topics(settings, last)


async def _readyz(host: WorkerProcess, model: str) -> tuple[int, str]:
    """The host's ``/readyz?model=`` answer for ``model`` (the host's ``/readyz`` for
    ""): status and body."""
    port = host.metrics_port()
    if port is None:
        return 0, "no metrics port in the host's log"
    status, body = await http_get(port, f"/readyz?model={model}" if model else "/readyz")
    return status, body[:400].decode(errors="replace")
