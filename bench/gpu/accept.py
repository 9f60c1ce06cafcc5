"""The GPU acceptance run: what a change to the model, decode, fleet or GPU bench code
must pass on a GPU host before its issue is resolved (``bench/gpu-accept.sh``).

First each compile form (the default, ``package``, then ``static`` and ``dynamic``)
is compiled into the compile cache, all at once, by a host of two processes each. Then
for each form, on one card and, on a host with several, on every card: the default
command (``conveyor worker --model M --weights W``, nothing else but
``--compile-form`` and ``--gpus``) started from that warm cache, as a restart starts,
timed to ready, then

- **served == direct**: 256 images answered by the host agree with a direct eager
  forward of the same weights, with the worker's defaults (float16), on the same kind
  of card, within float16's own tolerance: what float16 itself moves the scores,
  measured in the same call as the eager float16 forward against the eager float32
  one. Every served score within twice that largest move (0.01 at least) of the
  direct softmax's, and top-1 differing for no more images than twice float16's
  count (1% at least). A compiled forward reorders and fuses float16 arithmetic, so
  it cannot be held to bit equality; it can be held to float16's own noise;
- **throughput**: a backlog's steady-state rate, over the ceiling measured in the
  same call (the compiled forward at the batch size, and decode+resize: the
  ``forward`` and ``decode`` stages that run before this one);
- with the default form on every card: one process **SIGKILLed** mid-backlog (started
  again, lost 0) and a **SIGHUP** mid-backlog (every process restarted in turn, lost 0).

The weights are random but made to behave like trained ones where agreement is
judged: batch-norm statistics taken from the corpus (as training would have left
them) and the last layer scaled so that logits spread (a random classifier's
near-uniform scores would make top-1 a coin toss at fp16's precision). They are
saved to a file and served with ``--weights FILE``, as a user's fine-tuned model is.

Prints one table with pass or fail per row and writes ``accept.json`` (with the
commit) beside the other results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu.config import Config
from bench.gpu.cores import _pin_services
from bench.gpu.corpus import Corpus
from bench.gpu.e2e import UtilizationSampler, _steady_state
from bench.gpu.host import _await_results, _fleet, _start_host
from bench.gpu.load import _produce_parallel
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    WorkerProcess,
    produce,
    read_results,
    tally,
    until,
    until_all_ready,
    until_answered,
)
from schemas import DEFAULT_LIMITS, ContentType, encode_request, topics_for
from workers.handlers.base import Collating, ImageClassifier
from workers.model.loader import load_handler

FORMS = ("package", "static", "dynamic")
"""``--compile-form``'s values, the default first."""

AGREEMENT_IMAGES = 256
NOISE_FACTOR = 2.0  # served against direct may differ by twice what float16 moves
MIN_SCORE_TOLERANCE = 0.01
SCALING_FLOOR = {2: 1.9}  # the least speed-up over one card; 0.9 a card from four cards on
MIN_TOP1_TOLERANCE = 0.01  # a share of the images
_LOGIT_SPREAD = 4.0  # the standard deviation of the scaled last layer's logits


def stage_accept(
    cfg: Config, corpora: Sequence[Corpus], args: argparse.Namespace
) -> dict[str, Any]:
    return asyncio.run(_accept(cfg, corpora[-1], args))


async def _accept(cfg: Config, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    _pin_services(args)
    folder = Path(tempfile.mkdtemp(prefix="conveyor-accept-"))  # not in --out: 100 MB
    try:
        return await _accept_with(cfg, corpus, args, folder / "weights.pt")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _accept_with(
    cfg: Config, corpus: Corpus, args: argparse.Namespace, weights: Path
) -> dict[str, Any]:
    _trained_like(cfg, corpus, weights)
    direct = _direct_scores(cfg, corpus, weights, "auto")
    floor = _compare(direct, _direct_scores(cfg, corpus, weights, "float32"), top_k=5)
    print(f"  accept: float16 against float32, eager: {json.dumps(floor)}", flush=True)
    cards = torch.cuda.device_count() if cfg.device.type == "cuda" else 0
    layouts = [int(n) for n in args.accept_cards.split(",") if n.strip()] or card_layouts(cards)
    forms = [form.strip() for form in args.accept_forms.split(",") if form.strip()]
    rows: dict[str, Any] = {
        "cards": cards,
        "commit": _commit(),
        "weights": "trained-like",
        "float16_noise": floor,
        "runs": {},
    }
    if len(forms) * len(layouts) > 1:
        rows["compile_s"] = await _compile_forms(cfg, args, weights, forms)
        print(f"  accept: compiled, side by side: {json.dumps(rows['compile_s'])}", flush=True)
    for form in forms:
        for gpus in layouts:
            label = f"{form} x{gpus}"
            faults = form == FORMS[0] and gpus == layouts[-1]
            print(f"  accept {label}", flush=True)
            try:
                row = await _host_run(cfg, corpus, args, weights, direct, form, gpus, faults)
            except Exception as exc:  # a failed row is a result: the others still run
                row = {"error": f"{type(exc).__name__}: {exc}"}
            row["passed"] = _passed(row, faults, floor)
            _scaling(row, rows["runs"].get(f"{form} x1"), gpus)
            rows["runs"][label] = row
            print(f"  accept {label}: {json.dumps(row, default=str)}", flush=True)
            (args.out / "accept.json").write_text(json.dumps(rows, indent=2, default=str))
    return rows


# -- the weights and the direct forward ----------------------------------------------------


def card_layouts(cards: int) -> list[int]:
    """The numbers of cards a form runs on: one, every power of two below the host's
    count, and all of them (2 cards → [1, 2]; 4 → [1, 2, 4]; 6 → [1, 2, 4, 6])."""
    layouts = [1]
    while layouts[-1] * 2 < cards:
        layouts.append(layouts[-1] * 2)
    return [*layouts, cards] if cards > 1 else layouts


def _trained_like(cfg: Config, corpus: Corpus, path: Path) -> None:
    """Random weights with batch-norm statistics from ``corpus`` and a last layer whose
    logits spread, saved to ``path``."""
    torch.manual_seed(0)
    handler = _handler(cfg, "random", dtype="float32", decode="cpu")
    module = handler.module
    images = corpus.payloads[:64]
    pixels = torch.stack([handler.preprocess(p, ContentType.JPEG, {}) for p in images])
    inputs = handler.normalize(pixels)
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the calibration batch
    with torch.no_grad():
        module.train()
        module(inputs)
        module.eval()
        logits = module(inputs).float()
        last = [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1]
        scale = _LOGIT_SPREAD / float(logits.std())
        last.weight.mul_(scale)
        if last.bias is not None:
            last.bias.mul_(scale)
    torch.save(module.state_dict(), path)


def _direct_scores(cfg: Config, corpus: Corpus, weights: Path, dtype: str) -> torch.Tensor:
    """Softmax scores (images × classes) of a direct eager forward of ``weights`` in
    ``dtype`` (``auto``: the worker's default), with the worker's own layout and decode
    on the same kind of card."""
    handler = _handler(cfg, str(weights), dtype=dtype, decode="auto")
    payloads = _agreement_payloads(corpus)
    items = [handler.preprocess(p, ContentType.JPEG, {}) for p in payloads]
    scores = []
    with torch.inference_mode():
        for start in range(0, len(items), 64):
            chunk = items[start : start + 64]
            batch = None
            if isinstance(handler, Collating):
                batch = handler.collate(chunk, handler.device)
            if batch is None:
                batch = torch.stack(chunk).to(handler.device)
            scores.append(handler.forward(batch).float().softmax(dim=-1).cpu())
    return torch.cat(scores)


def _handler(cfg: Config, weights: str, *, dtype: str, decode: str) -> ImageClassifier:
    handler = load_handler(
        cfg.model,
        device=str(cfg.device),
        weights=weights,
        dtype=dtype,
        channels_last=None,
        limits=DEFAULT_LIMITS,
        decode=decode,  # type: ignore[arg-type]
    )
    if not isinstance(handler, ImageClassifier):
        raise SystemExit(f"accept: {cfg.model} is not an image classifier")
    return handler


def _agreement_payloads(corpus: Corpus) -> list[bytes]:
    return [corpus.payloads[n % len(corpus.payloads)] for n in range(AGREEMENT_IMAGES)]


# -- one host ------------------------------------------------------------------------------


async def _host_run(
    cfg: Config,
    corpus: Corpus,
    args: argparse.Namespace,
    weights: Path,
    direct: torch.Tensor,
    form: str,
    gpus: int,
    faults: bool,
) -> dict[str, Any]:
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    model = f"gpuaccept{form}{gpus}r{run}"
    partitions = 8 * gpus
    await create_model_topics(settings, model, partitions)
    timed = _form_args(args, weights, form)
    row: dict[str, Any] = {"form": form, "gpus": gpus}
    fleet = _fleet(cfg, model, timed)
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, timed, None, gpus)
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        row["ready_s"] = round(time.monotonic() - started, 1)
        row["processes"] = len(host.children())
        row["command"] = " ".join(host.config.argv()[3:])
        row.update(await _agreement(args, model, corpus, direct, host, run))
        target = _Target(model, partitions, host, max(gpus, 1))
        row.update(await _throughput(cfg, args, corpus, target, f"{run}-t"))
        faults = faults and len(host.children()) > 1  # a supervisor (not the CPU's one process)
        row["faults"] = faults
        if faults:
            row["kill"] = await _kill(cfg, args, corpus, target, f"{run}k")
            row["sighup"] = await _sighup(cfg, args, corpus, target, f"{run}h")
        row["failed_at_start"] = host.log().count("failed at start the same way")
    finally:
        (args.out / f"accept-{form}-x{gpus}.log").write_text(fleet.logs())
        await fleet.aclose()
        await delete_model_topics(settings, model)
    return row


def _form_args(args: argparse.Namespace, weights: Path, form: str) -> argparse.Namespace:
    """``args`` for a host of the default command with ``form``: the weights, and
    ``--compile-form`` unless it is the default."""
    options = f"{args.worker_options} --weights {weights}"
    if form != FORMS[0]:
        options += f" --compile-form {form}"
    return argparse.Namespace(**{**vars(args), "worker_options": options})


async def _compile_forms(
    cfg: Config, args: argparse.Namespace, weights: Path, forms: Sequence[str]
) -> dict[str, float]:
    """Each form's compiled forward built into the compile cache at once, by a host of
    two processes on the first card each (its supervisor records what a process takes
    of the card), before any row: every row then starts as a user's restart does, from
    a warm cache. Seconds each took, compiling side by side (on one card alone:
    ``bench.gpu --stages ready``)."""
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]

    async def one(n: int, form: str) -> float:
        model = f"gpuacceptcompile{form}r{run}"
        await create_model_topics(settings, model, 2)
        side = _form_args(args, weights, form)
        side.metrics_port = args.metrics_port + 1 + n  # the hosts run at once
        fleet = _fleet(cfg, model, side)
        try:
            started = time.monotonic()
            host = _start_host(fleet, cfg, side, 2, 1)  # a supervisor: it records memory
            await until_all_ready([host], args.ready_timeout)
            return round(time.monotonic() - started, 1)
        finally:
            (args.out / f"accept-compile-{form}.log").write_text(fleet.logs())
            await fleet.aclose()
            await delete_model_topics(settings, model)

    seconds = await asyncio.gather(*(one(n, form) for n, form in enumerate(forms)))
    return dict(zip(forms, seconds, strict=True))


async def _agreement(
    args: argparse.Namespace,
    model: str,
    corpus: Corpus,
    direct: torch.Tensor,
    host: WorkerProcess,
    run: str,
) -> dict[str, Any]:
    ids = [f"{run}-a-{n}" for n in range(AGREEMENT_IMAGES)]
    records = [
        encode_request(payload, request_id=i, content_type=ContentType.JPEG, source="accept")
        for payload, i in zip(_agreement_payloads(corpus), ids, strict=True)
    ]
    await produce(args.kafka_bootstrap, topics_for(model).requests, records)
    await host.unless_it_dies(until_answered(args.redis_url, ids, len(ids), 120))
    results = await read_results(args.redis_url, ids)
    served = torch.zeros_like(direct)
    top1 = torch.zeros(len(ids), dtype=torch.long)
    for n, request_id in enumerate(ids):
        outputs = results[request_id].outputs
        if not isinstance(outputs, list) or not outputs:
            raise RuntimeError(f"no classes in {results[request_id]}")
        top1[n] = int(outputs[0]["index"])
        for entry in outputs:
            served[n, int(entry["index"])] = float(entry["score"])
    return {
        "top1_agreement": float((top1 == direct.argmax(dim=-1)).float().mean()),
        "max_score_difference": float(((served - direct).abs() * (served > 0)).max()),
        "top1_direct_mean": float(direct.max(dim=-1).values.mean()),
    }


def _compare(scores: torch.Tensor, reference: torch.Tensor, top_k: int) -> dict[str, float]:
    """How far ``scores`` are from ``reference``: top-1 agreement, and the largest score
    difference over each image's ``top_k`` classes of ``scores`` (what a worker answers)."""
    _, indices = scores.topk(top_k, dim=-1)
    picked = (scores.gather(1, indices) - reference.gather(1, indices)).abs()
    return {
        "top1_agreement": float((scores.argmax(-1) == reference.argmax(-1)).float().mean()),
        "max_score_difference": float(picked.max()),
    }


@dataclass(frozen=True)
class _Target:
    """A host under test and its model's topics."""

    model: str
    partitions: int
    host: WorkerProcess
    cards: int


async def _backlog(
    cfg: Config, args: argparse.Namespace, corpus: Corpus, target: _Target, prefix: str
) -> list[str]:
    """A backlog of ``--e2e-count`` requests a card, visible at once; their ids (the
    steady state of four cards needs four times the backlog of one)."""
    count = cfg.e2e_count * target.cards
    await _produce_parallel(args, target.model, corpus, prefix, count, target.partitions)
    return [f"{prefix}-{n}" for n in range(count)]


async def _lost(args: argparse.Namespace, target: _Target, ids: list[str]) -> dict[str, int]:
    counted = await tally(
        args.kafka_bootstrap, args.redis_url, topics_for(target.model).results, ids
    )
    return {"lost": counted.lost, "duplicate_visible": counted.duplicate_visible}


async def _throughput(
    cfg: Config, args: argparse.Namespace, corpus: Corpus, target: _Target, prefix: str
) -> dict[str, Any]:
    """The steady state of one backlog (the bench's e2e stage: ``bench.gpu.e2e``)."""
    with UtilizationSampler(max(1, torch.cuda.device_count())) as gpu:
        ids = await _backlog(cfg, args, corpus, target, prefix)
        results = await _await_results(prefix, len(ids), args, [target.host])
    steady = _steady_state(results, gpu)
    return {"img_s": steady["img_s"], "gpu_util_pct": steady["gpu_util_pct"]}


async def _kill(
    cfg: Config, args: argparse.Namespace, corpus: Corpus, target: _Target, prefix: str
) -> dict[str, Any]:
    """A process SIGKILLed once a third of a backlog is answered: lost 0, started again."""
    host = target.host
    ids = await _backlog(cfg, args, corpus, target, prefix)
    third = ids[: len(ids) // 3 : 7]
    await host.unless_it_dies(until_answered(args.redis_url, third, len(third)))
    victim = host.children()[0]
    os.kill(victim, signal.SIGKILL)
    lost = await _lost(args, target, ids)
    await until_all_ready([host], args.ready_timeout)
    return lost | {"started_again": victim not in host.children() and bool(host.children())}


async def _sighup(
    cfg: Config, args: argparse.Namespace, corpus: Corpus, target: _Target, prefix: str
) -> dict[str, Any]:
    """SIGHUP mid-backlog: every process restarted in turn, lost 0."""
    host = target.host
    before = set(host.children())
    started = time.monotonic()
    ids = await _backlog(cfg, args, corpus, target, prefix)
    host.signal(signal.SIGHUP)

    async def rolled() -> bool:
        return "rolling restart done" in host.log()

    await until(rolled, "the rolling restart is done", args.ready_timeout, host.log, [host])
    seconds = time.monotonic() - started
    return await _lost(args, target, ids) | {
        "all_restarted": not before & set(host.children()),
        "roll_s": round(seconds, 1),
    }


# -- the verdict ---------------------------------------------------------------------------


def _passed(row: dict[str, Any], faults: bool, floor: dict[str, float]) -> bool:
    if "error" in row:
        return False
    score_tolerance = max(MIN_SCORE_TOLERANCE, NOISE_FACTOR * floor["max_score_difference"])
    top1_tolerance = max(MIN_TOP1_TOLERANCE, NOISE_FACTOR * (1 - floor["top1_agreement"]))
    row["score_tolerance"] = score_tolerance
    row["top1_tolerance"] = top1_tolerance
    ok: bool = (
        1 - row["top1_agreement"] <= top1_tolerance
        and row["max_score_difference"] <= score_tolerance
        and row["failed_at_start"] == 0
    )
    if faults and row["faults"]:
        ok = ok and row["kill"]["lost"] == 0 and row["kill"]["started_again"]
        ok = ok and row["sighup"]["lost"] == 0 and row["sighup"]["all_restarted"]
    return ok


def scaling_floor(gpus: int) -> float:
    """The least img/s of ``gpus`` cards over one card's that passes."""
    return SCALING_FLOOR.get(gpus, 0.9 * gpus)


def _scaling(row: dict[str, Any], one: dict[str, Any] | None, gpus: int) -> None:
    """A row of several cards against the same form on one card, in place."""
    if gpus <= 1 or not one or "img_s" not in row or not one.get("img_s"):
        return
    row["x_one_card"] = row["img_s"] / one["img_s"]
    row["scaling_floor"] = scaling_floor(gpus)
    row["passed"] = row["passed"] and row["x_one_card"] >= row["scaling_floor"]


def ceiling_share(rows: dict[str, Any], results: dict[str, Any], batch: int) -> None:
    """Each row's rate over the ceilings measured in the same call (the compiled forward
    at ``batch``; nvJPEG decode+resize of the corpus), one card's times the row's cards,
    in place."""
    forward = results.get("forward", {}).get("compiled", {}).get(str(batch), {}).get("img_s")
    decode = _decode_ceiling(results)
    ceiling = min(c for c in (forward, decode) if c) if (forward or decode) else None
    for row in rows["runs"].values():
        if "img_s" in row and ceiling:
            row["ceiling_img_s"] = ceiling
            row["forward_ceiling_img_s"] = forward
            row["decode_ceiling_img_s"] = decode
            row["of_ceiling"] = row["img_s"] / (ceiling * max(1, row.get("gpus", 1)))


def _decode_ceiling(results: dict[str, Any]) -> float | None:
    """nvJPEG's decode+resize of the corpus: the command's default decoder on a GPU."""
    row = results.get("decode", {}).get("224x224", {})
    rate = row.get("nvjpeg_decode_resize") if isinstance(row, dict) else None
    return float(rate) if rate else None


def print_accept_table(rows: dict[str, Any], card: str) -> None:
    commit, cards = rows.get("commit", "?"), rows.get("cards")
    print(f"\nGPU acceptance, {card}, commit {commit}, {cards} card(s)")
    if rows.get("compile_s"):
        took = ", ".join(f"{form} {s} s" for form, s in rows["compile_s"].items())
        print(f"Compiled first, side by side, two processes each: {took}; every row starts warm.")
    print(
        "| run | ready s | top-1 agree (tol.) | max Δscore (tol.) | img/s | ÷ ceiling "
        "| × one card (floor) | kill lost | SIGHUP lost | pass |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, row in rows["runs"].items():
        if "error" in row:
            print(f"| {label} | {row['error'][:80]} | | | | | | | | FAIL |")
            continue
        kill = row.get("kill", {}).get("lost", "")
        hup = row.get("sighup", {}).get("lost", "")
        share = f"{row['of_ceiling']:.2f}" if "of_ceiling" in row else ""
        scale = (
            f"{row['x_one_card']:.2f} (≥ {row['scaling_floor']:.2f})" if "x_one_card" in row else ""
        )
        print(
            f"| {label} | {row['ready_s']} | {row['top1_agreement']:.3f} "
            f"(≥ {1 - row.get('top1_tolerance', 0):.3f}) | {row['max_score_difference']:.4f} "
            f"(≤ {row.get('score_tolerance', 0):.4f}) | {row['img_s']:,.0f} | {share} | {scale} | "
            f"{kill} | "
            f"{hup} | {'pass' if row['passed'] else 'FAIL'} |"
        )


def _commit() -> str:
    """The commit measured: ``CONVEYOR_COMMIT`` (the device's copy of the tree has no
    history), else git's."""
    if os.environ.get("CONVEYOR_COMMIT"):
        return os.environ["CONVEYOR_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()
