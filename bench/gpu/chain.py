"""The ``chain`` stage: a detector, then a classifier on each of its boxes, through one
host file on one card (docs/models.md, "Pipelines"), and each stage's share of the card.

For the two specs of ``--chain`` (random weights for torchvision, timm and hf: models:
throughput only), in one call:

1. the detector alone (a host file of it alone): frames a second, ``D``;
2. both, the detector with ``then`` the classifier, every box above score 0 sent on,
   ``--chain-boxes`` at most an image: parent frames a second through both stages,
   ``P`` (each answered once all its crops are), and crops a frame, ``k``;
3. the classifier alone on those very crops (the child requests the pipeline sent,
   read back from its request topic and sent again as plain requests, once its host is
   ready, as many times over as make ``--chain-crops``): crops a second, ``C``.

Each stage's share of the card is the time it would take alone for what the pipeline
did: the detector ``P / D`` (the pipeline over the detector alone), the classifier
``P * k / C``; their sum is 1 where the pipeline uses the card as well as time-sharing
it between the two models allows. Each backlog is sized from the detector's rate alone
to last ``--chain-s``.

With ``--chain-streams N`` (64 by default), the pipeline's host then serves N camera
streams at ``--chain-fps`` each for ``--chain-streams-s``, paced, each stream's frames in
order (``bench.gpu.streams``): each stream's frame latency p50 and p99, the worst stream,
and whether every stream's p99 is within ``--stream-p99-bound-ms``.

``--chain-detector`` replaces the detector spec of ``--chain`` (``--chain-detector-options``
its ``model_options``); torchvision, timm and hf: specs are served with random weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu.config import Config
from bench.gpu.cores import _pin_services
from bench.gpu.corpus import Corpus
from bench.gpu.e2e import UtilizationSampler, _steady_state, sample_first
from bench.gpu.host import _await_results, _start_host
from bench.gpu.load import produce_at_once
from bench.gpu.streams import paced_streams, per_stream
from bench.gpu.zoo import built_config
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    WorkerConfig,
    await_results,
    produce,
    read_results,
    read_topic,
    unless_one_exits,
    until_all_ready,
)
from schemas import OutgoingRecord, topics_for
from schemas.chain import COUNT_H, INDEX_H, PARENT_H

CHAIN = "torchvision:fasterrcnn_resnet50_fpn,torchvision:resnet50"
_PARTITIONS = 8
_PROBE = 256  # frames of the first backlog, whose rate sizes the measured one
# The least measured backlog off --quick: four batches of 32 for each of eight processes
# (440-521 frames, two batches a process, measured 147-152 frames/s where 1,200 had
# measured 218: the ramp weighed on the steady state).
_LEAST = 1024
_CHILD_HEADERS = frozenset({PARENT_H, INDEX_H, COUNT_H})
# Random weights score every box about alike and below torchvision's defaults: keep them.
_DETECTOR_OPTIONS = "{ box_score_thresh = 0.0, score_threshold = 0.0 }"
_HF_OPTIONS = "{ score_threshold = 0.0 }"  # RT-DETR: its best queries, every score


def stage_chain(cfg: Config, corpora: Sequence[Corpus], args: argparse.Namespace) -> dict[str, Any]:
    _pin_services(args)
    corpus = next(c for c in corpora if c.name == "640x480") if len(corpora) > 1 else corpora[0]
    return asyncio.run(_chain(cfg, corpus, args))


async def _chain(cfg: Config, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    specs = [s.strip() for s in args.chain.split(",") if s.strip()]
    if len(specs) != 2:
        raise SystemExit(f"--chain: a detector spec and a classifier spec, not {specs}")
    if args.chain_detector:
        specs[0] = args.chain_detector
    built_config(specs[0])  # an hf: config the zoo builds (RT-DETR R50-vd): its folder
    run = uuid.uuid4().hex[:6]
    detector, classifier, crops = (f"gpuchain{part}{run}" for part in ("d", "c", "k"))
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    for name in (detector, classifier, crops):
        await create_model_topics(settings, name, _PARTITIONS)
    out: dict[str, Any] = {"detector": specs[0], "classifier": specs[1], "corpus": corpus.name}
    try:
        alone = await _serve(
            args, cfg, corpus, "detector", [(detector, specs[0], None)], None, detector
        )
        out["detector alone"] = alone
        _say(out, "detector alone")
        rate = alone["rate"]
        models = [(detector, specs[0], classifier), (classifier, specs[1], None)]
        both = await _serve(args, cfg, corpus, "both", models, rate, detector)
        out["both"] = both
        _say(out, "both")
        sent = await read_topic(
            args.kafka_bootstrap, topics_for(classifier).requests, expect=1, timeout_s=30
        )
        row = await _serve(args, cfg, None, "classifier", [(crops, specs[1], None)], sent)
        out["classifier alone"] = row
        _say(out, "classifier alone")
        out |= _shares(rate, both, row["rate"])
        _table(out)
    finally:
        for name in (detector, classifier, crops):
            await delete_model_topics(settings, name)
    return out


def _say(out: dict[str, Any], key: str) -> None:
    print(f"  chain {key}: {json.dumps(out[key], default=str)}", flush=True)


def _table(out: dict[str, Any]) -> None:
    """The stage's rows, last: each host's rate, the ratios, and the streams' latency."""
    rows = [
        ("detector alone", f"{out['detector alone']['rate']:,.1f} frames/s"),
        ("pipeline (detector, then classifier)", f"{out['both']['rate']:,.1f} frames/s"),
        (
            "classifier alone on the chain's crops",
            f"{out['classifier alone']['rate']:,.1f} crops/s",
        ),
        ("pipeline / detector alone", f"{out['pipeline_over_detector']:.3f}"),
        ("sum of shares", f"{out['sum_of_shares']:.3f}"),
    ]
    streams = out["both"].get("streams")
    if streams is not None:
        rows.append(
            (
                f"{streams['streams']} streams at {streams['fps']:g} frames/s",
                f"p50 {streams['p50_ms']} ms, p99 {streams['p99_ms']} ms; worst stream "
                f"{streams['worst_stream']} p99 {streams['worst_p99_ms']} ms against "
                f"{streams['bound_ms']:g} ms: {'within' if streams['within_bound'] else 'OVER'}; "
                f"{streams['out_of_order']} frames out of order; {streams['missing']} of "
                f"{streams['sent']} unanswered",
            )
        )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  chain | {name:<{width}} | {value}", flush=True)


def _shares(detector_rate: float, both: dict[str, Any], classifier_rate: float) -> dict[str, Any]:
    frames, per_frame = both["rate"], both["crops_per_frame"]
    detector = frames / detector_rate
    classifier = frames * per_frame / classifier_rate
    return {
        "pipeline_over_detector": round(detector, 3),
        "classifier_crops_s": classifier_rate,
        "detector_share": round(detector, 3),
        "classifier_share": round(classifier, 3),
        "sum_of_shares": round(detector + classifier, 3),
    }


def _host_file(
    folder: Path,
    label: str,
    models: Sequence[tuple[str, str, str | None]],
    boxes: int,
    detector: str | None,
    options: str | None = None,
) -> Path:
    """A host file of ``models`` (topic name, spec, the model its boxes go to or None).
    A torchvision or ``hf:`` ``detector`` keeps every box, alone or not, so that it does
    the same work in both hosts it is measured in."""
    lines = []
    for name, spec, then in models:
        lines += ["[[models]]", f'model = "{spec}"', f'model_name = "{name}"']
        if spec.startswith(("torchvision:", "timm:", "hf:")):
            lines.append('weights = "random"')
        if name == detector and (options or spec.startswith(("torchvision:", "hf:"))):
            every_box = _DETECTOR_OPTIONS if spec.startswith("torchvision:") else _HF_OPTIONS
            lines.append(f"model_options = {options or every_box}")
        if then is not None:
            lines.append(f'then = "{then}"')
            lines.append(f"then_options = {{ min_score = 0.0, max_children = {boxes} }}")
        lines.append("")
    path = folder / f"host-chain-{label}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


async def _serve(
    args: argparse.Namespace,
    cfg: Config,
    corpus: Corpus | None,
    label: str,
    models: Sequence[tuple[str, str, str | None]],
    sized: float | Sequence[Any] | None,
    detector: str | None = None,
) -> dict[str, Any]:
    """One host of ``models`` (``detector``: the detector's name among them); once it is
    ready, a backlog for the first of them: ``corpus`` frames sized to last ``--chain-s``
    at ``sized`` frames a second, ``_LEAST`` at least (measured on a first backlog of
    ``_PROBE`` frames when None: a detector serves a few hundred frames a second, a
    classifier tens of thousands), or, without a corpus, the child records ``sized``
    sent again as plain requests. Its rate in steady state."""
    path = _host_file(
        args.out / "hosts", label, models, args.chain_boxes, detector, args.chain_detector_options
    )
    options = ("--config-file", str(path), "--metrics-host", "127.0.0.1")
    config = WorkerConfig(label, args.kafka_bootstrap, args.redis_url, model="", options=options)
    fleet = Fleet(config, args.out / "workers" / f"chain-{label}")
    first = models[0][0]
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, args, None, 1)
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        ready_s = time.monotonic() - started
        prefix = f"chain-{label}-{first}"
        samplers: list[subprocess.Popen[bytes]] = []
        with UtilizationSampler(1) as gpu:
            if isinstance(sized, Sequence):
                prefix = f"chain-crop-{first}"
                count = await _resend_crops(args, sized, first, prefix)
                if args.profile_s:  # py-spy on a classifier process as it serves the crops
                    samplers.append(sample_first(args, host, "pyspy-chain-classifier"))
            elif corpus is not None:
                if sized is None:  # the first host: a short backlog measures the rate to size by
                    probe = [(first, f"{prefix}-probe", _PROBE)]
                    await produce_at_once(args, corpus, probe, _PARTITIONS)
                    probed = await _await_results(f"{prefix}-probe", _PROBE, args, [host])
                    sized = _steady_state(probed, gpu)["first_to_last_img_s"]
                least = _PROBE if args.quick else _LEAST
                count = max(least, math.ceil(sized * args.chain_s))
                await produce_at_once(args, corpus, [(first, prefix, count)], _PARTITIONS)
            results = await _await_results(prefix, count, args, [host])
        for sampler in samplers:
            sampler.wait(timeout=args.profile_s + 30)
        steady = _steady_state(results, gpu)
        row: dict[str, Any] = {
            "ready_s": round(ready_s, 1),
            "processes": len(host.children()),
            "count": count,
            "rate": steady["img_s"],
            "gpu_util_pct": steady["gpu_util_pct"],
            "host_file": path.read_text(),
        }
        if any(then is not None for _, _, then in models):
            children = [len(_boxes_sent(r.outputs)) for r in results]
            row["crops_per_frame"] = sum(children) / len(children)
            if corpus is not None and args.chain_streams > 0:
                row["streams"] = await _streams(args, corpus, first, host)
        return row
    finally:
        (args.out / f"chain-{label}.log").write_text(fleet.logs())
        await fleet.aclose()


async def _streams(
    args: argparse.Namespace, corpus: Corpus, first: str, host: Any
) -> dict[str, Any]:
    """``--chain-streams`` camera streams through the host already serving, paced
    (``bench.gpu.streams``): each stream's latency and order, and the worst stream."""
    prefix = f"chain-streams-{first}"
    frames = max(1, math.ceil(args.chain_fps * args.chain_streams_s))
    sent = await paced_streams(args, first, corpus, prefix, frames)
    ids = [f"{prefix}-{n}" for n in range(args.chain_streams * frames)]
    # A pipeline slower than the streams' rate answers late, not never: what is answered
    # within --e2e-timeout is reported, with the count missing, instead of no row at all.
    missing = await unless_one_exits([host], await_results(args.redis_url, ids, args.e2e_timeout))
    results = list((await read_results(args.redis_url, ids)).values())
    ok = [r for r in results if r.status.value == "ok"]
    summary = per_stream(ok, prefix, args.chain_streams, args.stream_p99_bound_ms)
    counts = {"sent": len(ids), "missing": len(missing), "not_ok": len(results) - len(ok)}
    # A frame never answered, or refused, is not within any bound.
    summary["within_bound"] = summary["within_bound"] and len(ok) == len(ids)
    return {"fps": args.chain_fps, "seconds": args.chain_streams_s} | sent | counts | summary


def _boxes_sent(outputs: Any) -> list[Any]:
    detections = outputs.get("detections", []) if isinstance(outputs, dict) else []
    return [d for d in detections if "next" in d]


async def _resend_crops(
    args: argparse.Namespace, sent: Sequence[Any], crops: str, prefix: str
) -> int:
    """The child records ``sent``, sent again to ``crops`` as plain requests (ids
    ``<prefix>-<n>``, no parent headers), as many times over as make ``--chain-crops``, in one
    transaction; how many."""
    records = []
    copies = -(-args.chain_crops // max(1, len(sent)))
    for n, record in enumerate(r for _ in range(copies) for r in sent):
        headers = [
            (k, f"{prefix}-{n}".encode() if k == "ce_id" else v)
            for k, v in record.headers
            if k not in _CHILD_HEADERS
        ]
        records.append(OutgoingRecord(f"{prefix}-{n}".encode(), record.value, headers))
    topic = topics_for(crops).requests  # in one transaction: visible to the host at once
    await produce(args.kafka_bootstrap, topic, records, transactional_id=prefix)
    return len(records)
