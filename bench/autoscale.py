"""The autoscaling rule of compose/k8s/, applied to real worker processes under changing load.

KEDA's Kafka scaler reports the consumer group's lag (records of the request
topic not yet committed) and Kubernetes' HPA turns it into a replica count:
``ceil(lag / lagThreshold)`` within ``[minReplicaCount, maxReplicaCount]``, left
alone within 10 % of the target, and changed no faster than the ScaledObject's
``behavior`` allows: scale-up at most ``Pods`` per period; scale-down to the
highest recommendation of the stabilization window, at most ``Pods`` per period.
``ScaleRule`` is that computation, pure and clocked by its caller;
``ScalePolicy.from_manifest`` reads its numbers from worker-scaledobject.yaml.

``run`` exercises it: a load profile (requests per second, step by step) goes
out through the SDK while a loop reads the group's lag from Kafka as KEDA does,
asks the rule for a worker count, and starts ``conveyor worker`` processes or
stops the newest (SIGTERM: it drains first) to match. Every poll is a
``Sample``: time, offered and answered rates, workers, lag, and the time to
drain (lag ÷ answered rate). The workers serve ``bench.paced`` (a fixed time per
batch), so each one adds the same capacity on any machine, as a GPU would.

``python -m bench.autoscale`` runs a load step against the services of ``make
up`` (or ``make up-cluster``) with the time constants compressed to fit a
couple of minutes, and writes ``autoscale.json`` and ``autoscale.png`` (plot
for docs/operations.md). tests/cluster/test_autoscale.py runs the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupCoordinatorNotAvailableError
from pydantic import SecretStr

from bench.identity import ITEM_BYTES
from bench.plot import Line, Timeline, draw_timelines
from producers.admin import create_model_topics
from producers.client import AsyncClient
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerConfig, WorkerProcess
from schemas import ContentType, consumer_group, topics_for

REPO = Path(__file__).resolve().parents[1]
SCALED_OBJECT = REPO / "compose" / "k8s" / "worker-scaledobject.yaml"
_RATE_WINDOW_S = 3.0  # answered rate: committed offsets over this long


@dataclass(frozen=True)
class ScalePolicy:
    """The numbers of a KEDA ScaledObject with a Kafka trigger (times in seconds)."""

    lag_threshold: int  # target lag per worker
    min_workers: int
    max_workers: int
    up_pods: int  # scale-up: at most this many workers added ...
    up_period_s: float  # ... per this long
    down_pods: int  # scale-down: at most this many removed ...
    down_period_s: float  # ... per this long,
    down_window_s: float  # to the highest recommendation of this window
    tolerance: float = 0.1  # the HPA leaves the count alone within ±10 % of the target

    def faster(self, factor: float) -> ScalePolicy:
        """The same rule with every period and window ``factor`` times shorter."""
        return replace(
            self,
            up_period_s=self.up_period_s / factor,
            down_period_s=self.down_period_s / factor,
            down_window_s=self.down_window_s / factor,
        )

    @classmethod
    def from_manifest(cls, path: Path = SCALED_OBJECT) -> ScalePolicy:
        spec = yaml.safe_load(path.read_text())["spec"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        [trigger] = spec["triggers"]
        [up] = behavior["scaleUp"]["policies"]
        [down] = behavior["scaleDown"]["policies"]
        assert up["type"] == down["type"] == "Pods", "only Pods policies are modelled"
        return cls(
            lag_threshold=int(trigger["metadata"]["lagThreshold"]),
            min_workers=int(spec["minReplicaCount"]),
            max_workers=int(spec["maxReplicaCount"]),
            up_pods=int(up["value"]),
            up_period_s=float(up["periodSeconds"]),
            down_pods=int(down["value"]),
            down_period_s=float(down["periodSeconds"]),
            down_window_s=float(behavior["scaleDown"]["stabilizationWindowSeconds"]),
        )


class ScaleRule:
    """How many workers the HPA asks for, given the lag now (``decide``, once per poll)."""

    def __init__(self, policy: ScalePolicy) -> None:
        self.policy = policy
        self._recommendations: deque[tuple[float, int]] = deque()
        self._changes: deque[tuple[float, int]] = deque()  # (when, workers added or removed)

    def recommend(self, lag: int, current: int) -> int:
        """The count the lag alone asks for: ceil(lag / threshold), within the bounds."""
        p = self.policy
        wanted = math.ceil(lag / p.lag_threshold)
        if current > 0 and abs(lag / (p.lag_threshold * current) - 1) <= p.tolerance:
            wanted = current
        return max(p.min_workers, min(p.max_workers, wanted))

    def decide(self, now: float, lag: int, current: int) -> int:
        """The worker count to run from ``now`` on (``now``: seconds, any monotonic clock)."""
        p = self.policy
        wanted = self.recommend(lag, current)
        self._recommendations.append((now, wanted))
        while self._recommendations[0][0] < now - p.down_window_s:
            self._recommendations.popleft()
        target = current
        if wanted > current:
            room = p.up_pods - self._moved(now, p.up_period_s, up=True)
            target = min(wanted, current + max(0, room))
        else:
            stable = max(count for _, count in self._recommendations)
            if stable < current:
                room = p.down_pods - self._moved(now, p.down_period_s, up=False)
                target = max(stable, current - max(0, room))
        if target != current:
            self._changes.append((now, target - current))
        return target

    def _moved(self, now: float, period_s: float, up: bool) -> int:
        """Workers added (``up``) or removed in the last ``period_s`` seconds."""
        return sum(
            abs(delta) for at, delta in self._changes if at > now - period_s and (delta > 0) == up
        )


@dataclass(frozen=True)
class Step:
    seconds: float  # how long the step lasts (with ``hold_s``: at most)
    rate: float  # requests per second offered during the step
    hold_s: float | None = None
    """When set, the step ends this long after the backlog it built fell back under the
    rule's target (``caught_up``), or at ``seconds`` if that never happens: a load that
    lasts until the workers caught up, however long starting them takes on the machine."""


@dataclass(frozen=True)
class RunConfig:
    bootstrap: str
    redis_url: str
    policy: ScalePolicy
    profile: Sequence[Step]
    log_dir: Path
    partitions: int = 6
    poll_s: float = 1.0
    batch_ms: float = 80.0  # bench.paced: with batches of 8, 100 requests/s per worker
    max_batch_size: int = 8
    settle_s: float = 90.0  # after the profile: until the backlog is 0 and the count at minimum
    replication_factor: int = 1
    redis_cluster: bool = False

    @property
    def worker_rate(self) -> float:
        """What one worker serves per second at full batches."""
        return self.max_batch_size * 1000.0 / self.batch_ms

    @property
    def target_drain_s(self) -> float:
        """The rule's target in time: one worker's share of lag, served at its rate."""
        return self.policy.lag_threshold / self.worker_rate


@dataclass
class Sample:
    t: float  # seconds since the start
    offered: float  # requests/s the profile offered at that moment
    answered: float  # requests/s committed over the last few seconds
    workers: int  # processes running (not yet told to stop)
    lag: int  # records not yet committed by the group
    drain_s: float  # lag / answered (inf while records wait and none are answered)


@dataclass
class Report:
    config: dict[str, Any]
    model: str
    samples: list[Sample] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    step_ends_s: list[float] = field(default_factory=list)  # when each step of the profile ended
    caught_up_at_s: float | None = None  # when the backlog fell back under target (``caught_up``)

    def summary(self, load_end_s: float) -> dict[str, Any]:
        """What the run did; ``load_end_s``: when the step's high load ended (for the record)."""
        counts = [s.workers for s in self.samples]
        peak = max(self.samples, key=lambda s: s.lag)
        threshold = self.config["policy"]["lag_threshold"]
        back = next(
            (s.t for s in self.samples if s.t > peak.t and s.lag <= threshold * s.workers), None
        )
        return {
            "workers_path": _changes(counts),
            "scaled_out_at_s": _first(self.samples, lambda s: s.workers == max(counts)),
            "peak_lag": peak.lag,
            "peak_lag_at_s": round(peak.t, 1),
            "back_under_target_at_s": None if back is None else round(back, 1),
            "scaled_in_at_s": _first(
                self.samples, lambda s: s.t > peak.t and s.workers == min(counts)
            ),
            "load_end_s": load_end_s,
            "final_lag": self.samples[-1].lag,
            "requests": len(self.request_ids),
        }


def _first(samples: Sequence[Sample], condition: Callable[[Sample], bool]) -> float | None:
    """The time of the first sample meeting ``condition``, if any."""
    return next((round(s.t, 1) for s in samples if condition(s)), None)


def _changes(counts: Sequence[int]) -> list[int]:
    """The worker counts in the order they were held: [1, 2, 3, 2, 1]."""
    path: list[int] = []
    for count in counts:
        if not path or path[-1] != count:
            path.append(count)
    return path


class GroupLag:
    """The consumer group's lag on the request topic, read as KEDA's Kafka scaler reads it."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int) -> None:
        self._group = group
        self._partitions = [TopicPartition(topic, n) for n in range(partitions)]
        self._admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        self._ends = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)

    async def start(self) -> None:
        await self._admin.start()
        await self._ends.start()

    async def stop(self) -> None:
        await self._ends.stop()
        await self._admin.close()

    async def read(self) -> tuple[int, int]:
        """(lag, committed): records not yet committed, and the sum of committed offsets."""
        ends = await self._ends.end_offsets(self._partitions)
        try:
            offsets = await self._admin.list_consumer_group_offsets(self._group)
        except GroupCoordinatorNotAvailableError:  # no member joined yet: nothing committed
            offsets = {}
        committed = {tp: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}
        lag = sum(ends[tp] - committed.get(tp, 0) for tp in self._partitions)
        return lag, sum(committed.values())


class Replicas:
    """``conveyor worker`` processes of one model, started and stopped by count; logs in
    ``log_dir/<model>/``."""

    def __init__(self, config: RunConfig, model: str) -> None:
        worker = WorkerConfig(
            model,
            config.bootstrap,
            config.redis_url,
            model="bench.paced:PacedHandler",
            options=(
                *(["--redis-cluster"] if config.redis_cluster else []),
                *("--decode-threads", "1", "--max-batch-size", str(config.max_batch_size)),
                *("--session-timeout-ms", "6000"),
            ),
            # The paced model reads its batch time from the environment.
            env={"CONVEYOR_PACED_BATCH_MS": f"{config.batch_ms:g}"},
        )
        # Sessions of their own: a Ctrl-C reaches only the benchmark, which drains them.
        self._fleet = Fleet(worker, config.log_dir / model, new_session=True)
        self._running: list[WorkerProcess] = []
        self._stopping: set[asyncio.Task[None]] = set()

    @property
    def size(self) -> int:
        return len(self._running)

    async def scale_to(self, count: int) -> None:
        while self.size < count:
            self._running.append(self._fleet.start())
        while self.size > count:
            newest = self._running.pop()  # as a StatefulSet removes its highest ordinal
            task = asyncio.create_task(newest.aclose())  # the drain runs on; the loop goes on
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def aclose(self) -> None:
        await self.scale_to(0)
        await asyncio.gather(*list(self._stopping))


def caught_up(lag: int, workers: int, peak_lag: int, threshold: int) -> bool:
    """Whether a backlog built up (``peak_lag`` over twice ``threshold``, one worker's
    target) and the lag fell back under the target of the ``workers`` serving it, and to
    half its peak at most: a lag still growing is under the target of workers just asked
    for, before they serve, without anything having caught up."""
    return peak_lag > 2 * threshold and lag <= min(threshold * workers, peak_lag / 2)


class Load:
    """Sends the profile's requests through the SDK, 10 sends a second; remembers the ids
    and when each step ended (``time.monotonic()``)."""

    def __init__(self, config: RunConfig, model: str) -> None:
        self._config, self._model = config, model
        self.ids: list[str] = []
        self.offered = 0.0
        self.step_ends: list[float] = []
        self.caught_up_at: float | None = None  # set by the control loop (``caught_up``)

    async def run(self) -> None:
        settings = ClientSettings(
            kafka_bootstrap=self._config.bootstrap, redis_url=SecretStr(self._config.redis_url)
        )
        payload = b"autoscale".ljust(ITEM_BYTES, b".")  # the paced model echoes it
        tick = 0.1
        async with AsyncClient(settings) as client:
            start, due = time.monotonic(), 0.0
            for step in self._config.profile:
                self.offered = step.rate
                owed, until = 0.0, due + step.seconds
                while due < min(until, self._held_until(step, start)):
                    owed += step.rate * tick
                    count, owed = int(owed), owed - int(owed)
                    ids = [f"{self._model}-{len(self.ids) + n}" for n in range(count)]
                    if ids:
                        await client.submit_many(
                            [payload] * count,
                            model=self._model,
                            request_ids=ids,
                            content_type=ContentType.TEXT,
                        )
                        self.ids += ids
                    due += tick
                    await asyncio.sleep(max(0.0, start + due - time.monotonic()))
                self.step_ends.append(time.monotonic())
        self.offered = 0.0

    def _held_until(self, step: Step, start: float) -> float:
        """When a ``hold_s`` step ends, in seconds since ``start`` (inf until caught up)."""
        if step.hold_s is None or self.caught_up_at is None:
            return math.inf
        return self.caught_up_at - start + step.hold_s


async def run(config: RunConfig) -> Report:
    """Run ``config.profile`` under the rule; every poll's sample is in the report."""
    model = f"autoscale-{uuid.uuid4().hex[:8]}"
    topics = topics_for(model)
    settings = ClientSettings(kafka_bootstrap=config.bootstrap)
    await create_model_topics(settings, model, config.partitions, config.replication_factor)
    report = Report(config=_describe(config), model=model)
    rule = ScaleRule(config.policy)
    fleet = Replicas(config, model)
    load = Load(config, model)
    lag_probe = GroupLag(
        config.bootstrap, consumer_group(model), topics.requests, config.partitions
    )
    await lag_probe.start()
    await fleet.scale_to(config.policy.min_workers)
    sending = asyncio.create_task(load.run())
    history: deque[tuple[float, int]] = deque()
    start = time.monotonic()
    load_end = sum(step.seconds for step in config.profile)
    peak_lag = 0
    try:
        while True:
            now = time.monotonic() - start
            lag, committed = await lag_probe.read()
            peak_lag = max(peak_lag, lag)
            threshold = config.policy.lag_threshold
            if load.caught_up_at is None and caught_up(lag, fleet.size, peak_lag, threshold):
                load.caught_up_at = start + now
            history.append((now, committed))
            while history[0][0] < now - _RATE_WINDOW_S:
                history.popleft()
            answered = _rate(history)
            report.samples.append(
                Sample(now, load.offered, answered, fleet.size, lag, _drain_s(lag, answered))
            )
            done = sending.done() and lag == 0 and fleet.size == config.policy.min_workers
            if done or now > load_end + config.settle_s:
                break
            await fleet.scale_to(rule.decide(now, lag, fleet.size))
            await asyncio.sleep(max(0.0, start + now + config.poll_s - time.monotonic()))
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        await fleet.aclose()
        await lag_probe.stop()
    report.request_ids = load.ids
    report.step_ends_s = [round(end - start, 1) for end in load.step_ends]
    if load.caught_up_at is not None:
        report.caught_up_at_s = round(load.caught_up_at - start, 1)
    return report


def _rate(history: deque[tuple[float, int]]) -> float:
    (t0, c0), (t1, c1) = history[0], history[-1]
    return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


def _drain_s(lag: int, rate: float) -> float:
    if lag <= 0:
        return 0.0
    return lag / rate if rate > 0 else math.inf


def _finite(value: float) -> float | None:
    """JSON has no infinity: null stands for "records wait and none are answered"."""
    return value if math.isfinite(value) else None


def _describe(config: RunConfig) -> dict[str, Any]:
    return {
        "policy": asdict(config.policy),
        "profile": [asdict(step) for step in config.profile],
        "partitions": config.partitions,
        "poll_s": config.poll_s,
        "worker_rate": config.worker_rate,
        "target_drain_s": config.target_drain_s,
    }


# -- the default run -------------------------------------------------------------------------

COMPRESSED = replace(
    ScalePolicy.from_manifest().faster(10),
    lag_threshold=300,  # 3 s of one paced worker's work
    max_workers=3,
)
"""worker-scaledobject.yaml's rule ten times faster (periods and window divided by 10),
a threshold of 3 s of one paced worker's work, and a cap of 3 workers."""

LOAD_STEP = (Step(8, 30), Step(150, 200, hold_s=15), Step(30, 30))
"""Light load, a step to twice one worker's capacity until 15 s after the workers caught up
with the backlog it built (at most 150 s), light load again."""


def plot(report: Report, path: Path) -> None:
    samples, c = report.samples, report.config
    times = [s.t for s in samples]
    target = c["target_drain_s"]
    threshold = c["policy"]["lag_threshold"]
    draw_timelines(
        [
            Timeline(
                "Load: requests offered and answered",
                "requests/s",
                times,
                {
                    "offered": [s.offered for s in samples],
                    "answered": [s.answered for s in samples],
                },
            ),
            Timeline(
                "Workers (the rule's count)",
                "workers",
                times,
                {"workers": [s.workers for s in samples]},
                steps=True,
            ),
            Timeline(
                "Backlog: the group's lag",
                "records",
                times,
                {
                    "lag": [s.lag for s in samples],
                    "threshold x workers": [threshold * s.workers for s in samples],
                },
            ),
            Timeline(
                "Time to drain the backlog: lag / answered rate (60 s: nothing answered yet)",
                "seconds",
                times,
                {"time to drain": [min(s.drain_s, 60.0) for s in samples]},
                [Line(target, f"target {target:g} s")],
            ),
        ],
        path,
        title=(
            f"Autoscaling on lag: lagThreshold {threshold}, workers "
            f"{c['policy']['min_workers']}-{c['policy']['max_workers']}, "
            f"{c['worker_rate']:g} requests/s per worker"
        ),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.autoscale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--replication-factor", type=int, default=1, help="3 on the cluster of make up-cluster"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="where JSON and PNG go")
    parser.add_argument("--log-dir", type=Path, default=REPO / ".run" / "bench")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    config = RunConfig(
        bootstrap=args.kafka_bootstrap,
        redis_url=args.redis_url,
        policy=COMPRESSED,
        profile=LOAD_STEP,
        log_dir=args.log_dir,
        replication_factor=args.replication_factor,
    )
    report = asyncio.run(run(config))
    summary = report.summary(report.step_ends_s[1])
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "autoscale.json", args.out / "autoscale.png"
    samples = [asdict(s) | {"drain_s": _finite(s.drain_s)} for s in report.samples]
    document = {"config": report.config, "summary": summary, "samples": samples}
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    plot(report, png_path)
    print(json.dumps(summary, indent=1))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
