"""The ``e2e`` stage: the one command's throughput and latency, layout by layout.

For each layout and corpus, the steady-state rate over ``--repeats`` backlogs (with
the GPU's busy share from ``nvidia-smi`` and each process's model stage from its
results' timings), then the latency to durability of a paced load at about half that
rate, its parts, and how busy each group of cores was meanwhile; py-spy samples of a
worker with ``--profile-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu.config import Config, _rate
from bench.gpu.cores import _core_times, _cores_busy, _pin_services
from bench.gpu.corpus import Corpus
from bench.gpu.host import (
    _await_results,
    _fleet,
    _start_host,
    expected_processes,
    layout_name,
    max_delay_ms_of,
    parse_layout,
)
from bench.gpu.load import _paced_parallel, _produce_parallel
from bench.gpu.report import _rounded
from bench.stats import (
    LATENCY_PARTS,
    MODEL_STAGE_KEYS,
    durable_ms,
    latency_summary,
    model_stage,
    parts_line,
)
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    WORKER_COMMAND,
    WorkerProcess,
    until_all_ready,
)


class UtilizationSampler:
    """``nvidia-smi`` in the background: the mean utilization of the first ``gpus`` cards,
    one sample every 200 ms."""

    def __init__(self, gpus: int = 1) -> None:
        self._gpus = gpus
        self._row: list[float] = []
        self.samples: list[tuple[float, float]] = []  # (epoch s, percent)
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilizationSampler:
        command = [
            "nvidia-smi",
            "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits",
            "-lms",
            "200",
            "-i",
            ",".join(str(n) for n in range(self._gpus)),
        ]
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        for line in self._proc.stdout:  # one line per card, cards in order
            try:
                self._row.append(float(line.strip()))
            except ValueError:
                continue
            if len(self._row) == self._gpus:
                self.samples.append((time.time(), statistics.fmean(self._row)))
                self._row = []

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def mean_between(self, start_s: float, end_s: float) -> float:
        inside = [p for t, p in self.samples if start_s <= t <= end_s]
        return statistics.fmean(inside) if inside else math.nan


def stage_e2e(
    cfg: Config,
    corpora: Sequence[Corpus],
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Each layout of ``--e2e-configs`` (processes a card x cards) on each corpus: the one
    command per host (``conveyor worker``, a supervisor and its processes), repeats per
    layout. ``checkpoint`` gets the rows so far after each (a run cut short keeps them)."""
    _pin_services(args)
    out: dict[str, Any] = {}
    variant = "".join(
        f"/{value}"
        for value, default in ((args.profile, "throughput"), (args.worker_decode, "auto"))
        if value != default
    )  # e.g. autox1/latency/gpu-hw: rows of several calls merge side by side
    for layout in args.e2e_configs.split(","):
        per_card, gpus = parse_layout(layout)

        def done(corpus: Corpus, row: dict[str, Any], layout: str = layout + variant) -> None:
            key = f"{layout} {corpus.name}"
            out[key] = row
            print(f"  e2e {key}: {json.dumps(_rounded(row))}", flush=True)
            checkpoint(out)

        asyncio.run(_e2e_one(cfg, corpora, args, per_card, gpus, done))
    return out


async def _e2e_one(
    cfg: Config,
    corpora: Sequence[Corpus],
    args: argparse.Namespace,
    per_card: int | None,
    gpus: int,
    done: Callable[[Corpus, dict[str, Any]], None],
) -> None:
    """Start the one command (a partition for each of its processes) and wait until the
    host is ready and the group settled; then, corpus by corpus, produce backlogs (in
    parallel producer processes), time the steady state, and the latency at half that
    rate. ``done`` gets each corpus's row."""
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    processes = expected_processes(per_card, gpus, args)
    partitions = args.partitions or processes
    model = f"gpubench{layout_name(per_card, gpus)}r{run}"
    # "append": the broker stamps each request when it appends it, so the paced load's
    # latency runs from the request being in Kafka; the producers' own lag is
    # reported beside it (acknowledged after due).
    stamp = {"append": "LogAppendTime", "due": "CreateTime"}[args.latency_from]
    await create_model_topics(
        settings, model, partitions, configs={"requests": {"message.timestamp.type": stamp}}
    )
    fleet = _fleet(cfg, model, args)
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, args, per_card, gpus)
        # Ready: every process owns partitions; ready again a second later: settled.
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        ready_s = time.monotonic() - started
        for n, corpus in enumerate(corpora):
            row: dict[str, Any] = {
                "processes": len(host.children()) or 1,
                "gpus": gpus,
                "partitions": partitions,
                "compiled": cfg.device.type == "cuda" and "--no-compile" not in args.worker_options,
                "profile": args.profile,
                "decode": args.worker_decode,
                "latency_from": args.latency_from,
                "ready_s": ready_s if n == 0 else math.nan,  # the host's start, once
                "command": " ".join(host.config.argv()[len(WORKER_COMMAND) :]),
            }
            load = Load(model, f"{run}{n}", partitions, host, per_card, gpus)
            row.update(await _backlogs(cfg, corpus, args, load))
            row.update(await _paced(corpus, args, load, row["img_s"]))
            done(corpus, row)
    finally:
        await fleet.aclose()
        await delete_model_topics(settings, model)


async def _backlogs(
    cfg: Config, corpus: Corpus, args: argparse.Namespace, load: Load
) -> dict[str, Any]:
    """``--repeats`` backlogs, each produced at once: the steady state's median and spread."""
    runs = []
    for repeat in range(args.repeats):
        prefix = f"{load.run}-b{repeat}"
        samplers: list[subprocess.Popen[bytes]] = []

        def sample(repeat: int = repeat, samplers: list[Any] = samplers) -> None:
            if args.profile_s and args.profile_phase == "backlog" and repeat == 1:
                samplers.append(_profile(args, load.host, load.per_card, load.gpus, corpus))

        runs.append(await timed_backlog(args, load, corpus, prefix, cfg.e2e_count, sample))
        for sampler in samplers:
            sampler.wait(timeout=args.profile_s + 30)
        print(f"    repeat {repeat}: {json.dumps(_rounded(runs[-1]))}", flush=True)
    rates = sorted(r["img_s"] for r in runs)
    return {
        "runs": runs,
        "img_s": statistics.median(rates),
        "img_s_min": rates[0],
        "img_s_max": rates[-1],
        "gpu_util_pct": statistics.median(r["gpu_util_pct"] for r in runs),
        "mean_batch": statistics.median(r["mean_batch"] for r in runs),
    } | {key: statistics.median(r[key] for r in runs) for key in MODEL_STAGE_KEYS}


async def timed_backlog(
    args: argparse.Namespace,
    load: Load,
    corpus: Corpus,
    prefix: str,
    count: int,
    on_visible: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One backlog of ``count`` produced at once (``_produce_parallel``) and every result of
    it awaited: its steady state (``_steady_state``) and the producers' rate."""
    with UtilizationSampler(load.gpus) as gpu:
        produced = await _produce_parallel(
            args, load.model, corpus, prefix, count, load.partitions, on_visible=on_visible
        )
        results = await _await_results(prefix, count, args, [load.host])
    return _steady_state(results, gpu) | {"producer_img_s": produced}


@dataclass(frozen=True)
class Load:
    """Where a layout's load goes: its model's topics, its run id, the host serving it."""

    model: str
    run: str
    partitions: int
    host: WorkerProcess
    per_card: int | None
    gpus: int


async def _paced(
    corpus: Corpus, args: argparse.Namespace, load: Load, peak: float
) -> dict[str, Any]:
    """Latency at about half the peak, open loop (each record stamped when due)."""
    model, run, partitions, host = load.model, load.run, load.partitions, load.host
    per_card, gpus = load.per_card, load.gpus
    paced_rate = min(peak / 2, args.paced_max_rate)
    count = max(int(paced_rate * args.paced_s), 1)
    paced_samplers: list[subprocess.Popen[bytes]] = []
    cores_at_go: dict[int, tuple[int, int]] = {}

    def sample_paced() -> None:
        cores_at_go.update(_core_times())
        if args.profile_s and args.profile_phase == "paced":
            paced_samplers.append(_profile(args, host, per_card, gpus, corpus))

    if args.paced_warmup_s > 0:  # the same load, unmeasured: the broker's first is slower
        warmup = max(int(paced_rate * args.paced_warmup_s), 1)
        await _paced_parallel(args, model, corpus, f"{run}-w", warmup, paced_rate, partitions)
        await _await_results(f"{run}-w", warmup, args, [host])
    sent = await _paced_parallel(
        args, model, corpus, f"{run}-p", count, paced_rate, partitions, on_go=sample_paced
    )
    achieved = sent["rate"]
    # While the paced load was sent: a group near 100% queues everything it serves.
    cores_busy = _cores_busy(cores_at_go, _core_times(), args)
    paced = await _await_results(f"{run}-p", count, args, [host])
    for sampler in paced_samplers:
        sampler.wait(timeout=args.profile_s + 30)
    summary = latency_summary(paced)
    row = {
        "paced_rate": achieved,
        "paced_target": paced_rate,
        "paced_warmup_s": args.paced_warmup_s,
        # Producers that fell behind their rate (``paced_processes``): their own
        # lag would count as the workers' latency, so the row reports none.
        "paced_kept_up": achieved >= 0.95 * paced_rate,
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "paced_compute_p99_ms": summary["compute_p99_ms"],  # per batch
        "paced_mean_batch": summary["mean_batch_size"],
        "paced_cores_busy_pct": cores_busy,
        "in_worker_p50_ms": summary["in_worker_p50_ms"],
        "in_worker_p99_ms": summary["in_worker_p99_ms"],
        "acked_p50_ms": sent["acked_p50_ms"],
        "acked_p99_ms": sent["acked_p99_ms"],
        # The goal: p99 within max_delay + 2 x the p99 batch compute (docs/benchmarks.md).
        "latency_bound_ms": max_delay_ms_of(host.config.argv()) + 2 * summary["compute_p99_ms"],
    } | {key: value for key, value in summary.items() if key.startswith(LATENCY_PARTS)}
    print(
        f"[bench] {run} latency parts at {achieved:.0f}/s: {parts_line(row)} (worst producer);"
        f" in the worker {row['in_worker_p50_ms']:.1f}/{row['in_worker_p99_ms']:.1f} ms,"
        f" batches of {row['paced_mean_batch']:.1f}, compute p99"
        f" {row['paced_compute_p99_ms']:.1f} ms; cores busy (%)"
        f" {json.dumps({k: round(v, 1) for k, v in cores_busy.items()})}",
        flush=True,
    )
    return row


def _profile(
    args: argparse.Namespace, host: WorkerProcess, per_card: int | None, gpus: int, corpus: Corpus
) -> subprocess.Popen[bytes]:
    """``--profile-s`` seconds of py-spy samples of the host's first worker process (the
    supervisor itself when it runs just one), named by layout, corpus and phase."""
    name = f"pyspy-{layout_name(per_card, gpus)}-{corpus.name}-{args.profile_phase}"
    return sample_first(args, host, name)


def sample_first(
    args: argparse.Namespace, host: WorkerProcess, name: str
) -> subprocess.Popen[bytes]:
    """``--profile-s`` seconds of py-spy samples of ``host``'s first worker process (the
    supervisor itself when it runs just one) into ``<name>[-gil].txt`` in ``--out``."""
    gil = "-gil" if args.profile_gil else ""
    pid = next(iter(host.children()), host.pid)
    return _sample(pid, args.out / f"{name}{gil}.txt", args.profile_s, gil=args.profile_gil)


def _sample(pid: int, path: Path, seconds: float, *, gil: bool = False) -> subprocess.Popen[bytes]:
    """py-spy sampling a worker (every thread, 100 Hz) into collapsed stacks at ``path``,
    without pausing it for each sample: a worker paused for each sample had a p99 of
    262 ms under the paced load, against 54 in an unsampled run on another H100.
    ``gil``: only the thread holding the GIL at each sample."""
    beside = Path(sys.executable).with_name("py-spy")
    command = [
        str(beside) if beside.exists() else "py-spy", "record", "--pid", str(pid),
        "--rate", "100", "--threads", "--idle", "--nonblocking", "--duration", str(int(seconds)),
        "--format", "raw", "--output", str(path), *(["--gil"] if gil else []),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _steady_state(results: Sequence[Any], gpu: UtilizationSampler) -> dict[str, Any]:
    """The rate between the 10th and 90th percentile of the results' durable times: the
    first and last tenth (the backlog arriving, the last batches draining) left out."""
    durable = sorted(durable_ms(r) for r in results)
    low, high = durable[len(durable) // 10], durable[(len(durable) * 9) // 10]
    inside = sum(1 for t in durable if low <= t <= high)
    return {
        "img_s": _rate(inside - 1, (high - low) / 1000.0),
        "first_to_last_img_s": _rate(len(durable) - 1, (durable[-1] - durable[0]) / 1000.0),
        "gpu_util_pct": gpu.mean_between(low / 1000.0, high / 1000.0),
        "mean_batch": _mean_batch(results),
    } | model_stage(results, low, high)


def _mean_batch(results: Sequence[Any]) -> float:
    batches = {(r.worker, r.timings.batch_start_ms) for r in results if r.timings}
    return len(results) / len(batches) if batches else math.nan
