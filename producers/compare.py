"""Compare a model's shadow with what callers got: the same requests, answered by two versions.

A shadow (``conveyor worker --shadow``) answers every request of the model to
``<prefix>.<model>.shadow-results``; the primary group's answers are on the model's
results topic. ``read_comparison`` reads the shadow topic from its start to its end
as it is now, then the results topic from the first of those requests' send time on,
joins the two by request id (each id's first result on each side: a redelivered
request's later copies repeat it) and ``compare`` measures how far they agree:

- status: both ``ok``, or both the same error;
- classification (a list of classes, best first): the top class agrees;
- detection, instance segmentation, keypoints: boxes matched greedily by IoU within a
  class, a match counting at IoU >= 0.5; the mean IoU of the matches, and the matches
  against the boxes of both sides (F1);
- embeddings: the cosine similarity of the two vectors;
- anything else: the outputs are identical;
- latency, per side: the batch's inference time, the request's wait in the worker, and
  from the request's send to its result's (p50, p90, p99).

Requests the primary answered to a ``ce_replyto`` topic are not on its results topic:
they count as answered by the shadow only, as do requests it has not answered yet.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from common.security import kafka_options
from producers.errors import InvalidInput, ServiceUnavailable, UnknownModel
from producers.settings import ClientSettings
from schemas import ContractError, Result, Status, decode_result, parse_outputs, topics_for
from schemas.outputs import (
    ClassScore,
    Detection,
    DetectionOutput,
    EmbeddingOutput,
    InstanceSegmentationOutput,
    KeypointsOutput,
)

__all__ = ["Agreement", "Comparison", "compare", "iou", "percentiles", "read_comparison"]

IOU_MATCH = 0.5
"""Two boxes of one class are the same object from this IoU on."""
_FETCH_MS = 1000
_BATCH = 5000
_PERCENTILES = (50, 90, 99)


@dataclass
class Agreement:
    """How often one kind of comparison agreed."""

    compared: int = 0
    agreed: int = 0

    def add(self, agreed: bool) -> None:
        self.compared += 1
        self.agreed += agreed

    @property
    def rate(self) -> float | None:
        return self.agreed / self.compared if self.compared else None


@dataclass
class Boxes:
    """Detections compared box by box."""

    compared: int = 0  # result pairs
    primary: int = 0  # boxes on each side
    shadow: int = 0
    matched: int = 0
    iou_sum: float = 0.0

    @property
    def mean_iou(self) -> float | None:
        return self.iou_sum / self.matched if self.matched else None

    @property
    def f1(self) -> float | None:
        both = self.primary + self.shadow
        return 2 * self.matched / both if both else None


@dataclass
class Similarity:
    """Embeddings compared by cosine similarity."""

    values: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


@dataclass
class Comparison:
    """The two versions on the same requests."""

    primary_versions: Counter[str] = field(default_factory=Counter)
    shadow_versions: Counter[str] = field(default_factory=Counter)
    joined: int = 0
    shadow_only: int = 0
    status: Agreement = field(default_factory=Agreement)
    top1: Agreement = field(default_factory=Agreement)
    boxes: Boxes = field(default_factory=Boxes)
    cosine: Similarity = field(default_factory=Similarity)
    identical: Agreement = field(default_factory=Agreement)
    latency_ms: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def document(self) -> dict[str, Any]:
        """The comparison as JSON-able data (what ``conveyor compare --json`` prints)."""
        cosines = self.cosine.values
        return {
            "primary_versions": dict(self.primary_versions),
            "shadow_versions": dict(self.shadow_versions),
            "joined": self.joined,
            "shadow_only": self.shadow_only,
            "status": _agreement(self.status),
            "top1": _agreement(self.top1),
            "boxes": {
                "compared": self.boxes.compared,
                "primary": self.boxes.primary,
                "shadow": self.boxes.shadow,
                "matched": self.boxes.matched,
                "mean_iou": self.boxes.mean_iou,
                "f1": self.boxes.f1,
            },
            "embedding_cosine": {
                "compared": len(cosines),
                "mean": self.cosine.mean,
                "min": min(cosines) if cosines else None,
            },
            "identical_outputs": _agreement(self.identical),
            "latency_ms": {
                side: {what: percentiles(values) for what, values in parts.items()}
                for side, parts in self.latency_ms.items()
            },
        }


def compare(primary: Mapping[str, Result], shadow: Mapping[str, Result]) -> Comparison:
    """Compare every request the shadow answered with what the primary answered."""
    found = Comparison()
    for result in primary.values():
        found.primary_versions[result.model_version] += 1
    for request_id, theirs in shadow.items():
        found.shadow_versions[theirs.model_version] += 1
        ours = primary.get(request_id)
        if ours is None:
            found.shadow_only += 1
            continue
        found.joined += 1
        found.status.add(ours.status == theirs.status)
        if ours.status is Status.ok and theirs.status is Status.ok:
            _outputs(found, ours.outputs, theirs.outputs)
        for side, result in (("primary", ours), ("shadow", theirs)):
            _latency(found.latency_ms.setdefault(side, {}), result)
    return found


def _outputs(found: Comparison, ours: Any, theirs: Any) -> None:
    try:
        mine, other = parse_outputs(ours), parse_outputs(theirs)
    except ContractError:  # not a shape of the contract: compare the documents
        found.identical.add(ours == theirs)
        return
    if isinstance(mine, list) and isinstance(other, list):
        found.top1.add(_top(mine) == _top(other))
    elif isinstance(mine, _DETECTIONS) and isinstance(other, _DETECTIONS):
        _match_boxes(found.boxes, mine.detections, other.detections)
    elif isinstance(mine, EmbeddingOutput) and isinstance(other, EmbeddingOutput):
        found.cosine.values.append(_cosine(mine.values(), other.values()))
    else:
        found.identical.add(ours == theirs)


_DETECTIONS = (DetectionOutput, InstanceSegmentationOutput, KeypointsOutput)


def _top(classes: Sequence[ClassScore]) -> int | None:
    return classes[0].index if classes else None


def _match_boxes(boxes: Boxes, ours: Sequence[Detection], theirs: Sequence[Detection]) -> None:
    boxes.compared += 1
    boxes.primary += len(ours)
    boxes.shadow += len(theirs)
    pairs = sorted(
        (
            (iou(a.box, b.box), i, j)
            for i, a in enumerate(ours)
            for j, b in enumerate(theirs)
            if a.index == b.index
        ),
        reverse=True,
    )
    taken_a: set[int] = set()
    taken_b: set[int] = set()
    for overlap, i, j in pairs:
        if overlap < IOU_MATCH:
            break
        if i in taken_a or j in taken_b:
            continue
        taken_a.add(i)
        taken_b.add(j)
        boxes.matched += 1
        boxes.iou_sum += overlap


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x0, y0, x1, y1]`` boxes."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, width) * max(0.0, height)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        return 0.0
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _latency(parts: dict[str, list[float]], result: Result) -> None:
    timings = result.timings
    if timings is None:
        return
    parts.setdefault("inference", []).append(timings.inference_ms)
    parts.setdefault("queue", []).append(timings.queue_ms)
    done = timings.published_ms if timings.published_ms is not None else timings.finished_ms
    parts.setdefault("end_to_end", []).append(done - timings.produced_ms)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90 and p99 of ``values`` (nearest rank; None when there are none)."""
    ordered = sorted(values)
    return {f"p{p}": _rank(ordered, p) for p in _PERCENTILES}


def _rank(ordered: Sequence[float], percent: int) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, math.ceil(percent / 100 * len(ordered)) - 1)]


def _agreement(agreement: Agreement) -> dict[str, Any]:
    return {"compared": agreement.compared, "agreed": agreement.agreed, "rate": agreement.rate}


# -- reading both topics ---------------------------------------------------------------------


async def read_comparison(
    settings: ClientSettings, model: str, version: str | None = None
) -> tuple[Comparison, str, str]:
    """Read the model's shadow results (of ``version`` only, when given) and the primary's
    results of the same requests, and compare them; also returns the two topics' names.

    Raises ``InvalidInput`` for a bad model name, ``UnknownModel`` when the model has no
    shadow results topic, ``ServiceUnavailable`` when Kafka cannot be reached.
    """
    try:
        topics = topics_for(model, settings.topic_prefix)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=None,  # commits nothing, takes no partitions from anyone
        enable_auto_commit=False,
        isolation_level="read_committed",
        **kafka_options(settings),
    )
    try:
        await consumer.start()
        shadow = await _read_first(
            consumer,
            topics.shadow_results,
            model,
            lambda result: version is None or result.model_version == version,
        )
        since = min((r.timings.produced_ms for r in shadow.values() if r.timings), default=None)
        primary = {}
        if since is not None:
            primary = await _read_first(
                consumer, topics.results, model, lambda r: r.id in shadow, since_ms=since
            )
    except (KafkaError, OSError) as exc:
        raise ServiceUnavailable(
            f"cannot read the results of {model} from Kafka at {settings.kafka_bootstrap} "
            f"({exc or 'no answer in time'}): is it running (`make up`)?"
        ) from None
    finally:
        await consumer.stop()
    return compare(primary, shadow), topics.results, topics.shadow_results


async def _read_first(
    consumer: AIOKafkaConsumer,
    topic: str,
    model: str,
    keep: Callable[[Result], bool],
    since_ms: int | None = None,
) -> dict[str, Result]:
    """Each id's first result in ``topic`` (from ``since_ms`` on, else from its start, to
    its end as it is now) that ``keep`` takes."""
    cluster = await consumer._client.fetch_all_metadata()  # the public topics() gives names only
    partitions = cluster.partitions_for_topic(topic)
    if not partitions:
        raise UnknownModel(model, topic)
    assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(assigned)
    ends = await consumer.end_offsets(assigned)
    if since_ms is None:
        starts = await consumer.beginning_offsets(assigned)
    else:
        found = await consumer.offsets_for_times(dict.fromkeys(assigned, since_ms))
        starts = {tp: ends[tp] if at is None else at.offset for tp, at in found.items()}
    left = {tp: ends[tp] for tp in assigned if starts[tp] < ends[tp]}
    for tp in assigned:
        consumer.seek(tp, starts[tp])
    first: dict[str, Result] = {}
    while left:
        fetched = await consumer.getmany(*left, timeout_ms=_FETCH_MS, max_records=_BATCH)
        for tp, records in fetched.items():
            _take(first, (r.value for r in records if r.offset < left.get(tp, 0)), keep)
        for tp in list(left):  # transaction markers and aborted records move the position too
            if await consumer.position(tp) >= left[tp]:
                del left[tp]
    return first


def _take(
    first: dict[str, Result], values: Iterable[bytes | None], keep: Callable[[Result], bool]
) -> None:
    for value in values:
        try:
            result = decode_result(value or b"")
        except ContractError:
            continue  # not a result document
        if result.id not in first and keep(result):
            first[result.id] = result
