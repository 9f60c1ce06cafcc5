"""The ``text`` stage: text models end to end through Kafka with the one command's
defaults, against their forward ceiling in the same call.

For each model of ``--text-models`` (``bench.text``'s shapes: ``bert-base``, a
BERT-base-sized classifier; ``minilm``, a MiniLM-sized mean-pooled embedder; random
weights, ``bench.text``'s tokenizer and long-tailed mix of texts):

1. its folder, a config and a tokenizer (``.run/bench-text/NAME``; no weights: the
   worker runs ``--weights random``);
2. in this process, the handler ``hf:FOLDER`` loads in the dtype the worker runs
   (``--dtype auto``), on the same texts: ``bench.text.measure`` (the tokenizer alone,
   the worker's token batches against a fixed count padded to its longest, the eager
   forward alone), then on a GPU the forward of the same token batches compiled
   (``torch.compile``, dynamic shapes): the row's ceiling is the faster forward;
3. ``conveyor worker --model hf:FOLDER --weights random`` started with nothing else,
   its time to ready, a backlog's steady rate (texts/s), and at half that peak, open
   loop, the p99 against ``max_delay`` + 2 x the p99 batch compute. ``--profile-s``:
   py-spy samples of the first worker process as the backlog comes.

A row is written as each model finishes, so a run cut short keeps them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import text as text_bench
from bench.gpu.config import Config
from bench.gpu.cores import _pin_services
from bench.gpu.corpus import Corpus, text_corpus
from bench.gpu.e2e import Load, _paced, sample_first, timed_backlog
from bench.gpu.host import _fleet, _start_host
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import until_all_ready
from schemas import DEFAULT_LIMITS, ContentType
from workers.config.profiles import GPU_TEXT_BATCH
from workers.config.worker import WorkerSettings
from workers.handlers.tasks.text import TextModel
from workers.model.loader import auto_dtype, load_handler

TEXT_MODELS = ("bert-base", "minilm")
_BACKLOG_S = 8.0  # each backlog lasts about this long at the forward ceiling
_MIN_BACKLOG = 4096
_QUICK_BACKLOG = 1024
_PARTITIONS = 8


def write_folder(name: str, root: Path) -> Path:
    """``bench.text``'s model ``name`` as a folder ``hf:`` reads: its config (the
    classifier's architecture, or a bare encoder: a mean-pooled sentence embedder) and
    its tokenizer; no weights."""
    from transformers import BertConfig

    folder = (root / name).resolve()  # the worker may run elsewhere
    if (folder / "config.json").exists():
        return folder
    size = (text_bench.MODELS | text_bench.QUICK)[name]
    tokenizer = text_bench.tokenizer(8000)
    embedder = name == "minilm"
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], intermediate_size=size["intermediate"],
        max_position_embeddings=512, num_labels=3,
    )  # fmt: skip
    config.architectures = ["BertModel" if embedder else "BertForSequenceClassification"]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def stage_text(
    cfg: Config,
    corpora: Sequence[Corpus],
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    del corpora  # the text mix is its own corpus
    _pin_services(args)
    corpus = text_corpus()
    out: dict[str, Any] = {}
    for name in [s.strip() for s in args.text_models.split(",") if s.strip()]:
        print(f"  text {name}", flush=True)
        try:
            row = _one(cfg, name, corpus, args)
        except Exception as exc:  # one model's failure is its row; the others still run
            row = {"error": f"{type(exc).__name__}: {exc}"}
        out[name] = row
        print(f"  text {name}: {json.dumps(row, default=str)}", flush=True)
        checkpoint(out)
    return out


def _one(cfg: Config, name: str, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    folder = write_folder(name, Path(".run") / "bench-text")
    spec = f"hf:{folder}"
    row = ceiling(spec, corpus, cfg.device)
    count = max(_MIN_BACKLOG, math.ceil(row["ceiling_texts_s"] * _BACKLOG_S))
    if args.quick:  # a smoke run: that it runs, not its rate
        count = _QUICK_BACKLOG
    row |= asyncio.run(_served(cfg, spec, corpus, args, count))
    row["of_ceiling"] = row["texts_s"] / row["ceiling_texts_s"]
    variants: dict[str, Any] = {}
    for flags in [v.strip() for v in args.text_variants.split(";") if v.strip()]:
        told = argparse.Namespace(**vars(args))
        told.worker_options = f"{args.worker_options} {flags}".strip()
        told.profile_s = 0  # the default command's samples are the ones kept
        tag = "-" + "".join(c if c.isalnum() else "_" for c in flags).strip("_")
        try:
            served = asyncio.run(_served(cfg, spec, corpus, told, count, paced=False, tag=tag))
            served["of_ceiling"] = served["texts_s"] / row["ceiling_texts_s"]
        except Exception as exc:  # a variant's failure is its entry
            served = {"error": f"{type(exc).__name__}: {exc}"}
        variants[flags] = served
        print(f"  text {name} {flags}: {json.dumps(served, default=str)}", flush=True)
    if variants:
        row["variants"] = variants
    return row


def ceiling(spec: str, corpus: Corpus, device: torch.device) -> dict[str, Any]:
    """``bench.text``'s rows for ``spec`` in the worker's dtype and batches, and its
    token batches' forward compiled; the ceiling is the faster of the two forwards."""
    dtype = auto_dtype(spec, device)
    torch.manual_seed(0)
    handler = load_handler(
        spec, device=str(device), weights="random", dtype="auto", channels_last=None,
        limits=DEFAULT_LIMITS,
    )  # fmt: skip
    assert isinstance(handler, TextModel)
    budget = WorkerSettings.model_fields["max_batch_tokens"].default
    count = GPU_TEXT_BATCH if device.type == "cuda" else 32
    payloads = list(corpus.payloads)
    found = text_bench.measure(handler, payloads, budget, count)
    # Compiled on a GPU; on the CPU (a --quick smoke run) Inductor takes most of a minute.
    compiled_s, compile_s = (
        _compiled_forward(handler, payloads, budget, count)
        if device.type == "cuda"
        else (None, 0.0)
    )
    eager = found["forward"]["texts_per_s"]
    compiled = len(payloads) / compiled_s if compiled_s else math.nan
    del handler
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "texts": found["texts"],
        "tokens_median": found["tokens_median"],
        "tokens_p99": found["tokens_p99"],
        "in_process": found,
        "forward_eager_texts_s": eager,
        "forward_compiled_texts_s": compiled,
        "compile_s": compile_s,
        "ceiling_texts_s": max(eager, compiled if not math.isnan(compiled) else 0.0),
    }


def _compiled_forward(
    handler: TextModel, payloads: list[bytes], budget: int, count: int
) -> tuple[float | None, float]:
    """Seconds of the token batches' forward compiled with dynamic shapes (after a pass
    that compiles and warms each shape), and the seconds that pass took; ``None`` where
    compiling failed."""
    items = [
        item
        for item in handler.preprocess_batch(
            payloads, [ContentType.TEXT] * len(payloads), [{}] * len(payloads)
        )
        if isinstance(item, torch.Tensor)
    ]
    batches = text_bench.token_batches(handler, items, budget, count)
    eager = handler.forward
    started = time.perf_counter()
    try:
        handler.forward = torch.compile(eager, dynamic=True)  # type: ignore[method-assign]
        text_bench.forward_only(handler, batches)  # compiles, then every shape once
        compile_s = time.perf_counter() - started
        return text_bench.forward_only(handler, batches), compile_s
    except Exception as exc:  # the eager forward stays the ceiling
        print(f"  compiled forward failed: {type(exc).__name__}: {exc}", flush=True)
        return None, time.perf_counter() - started
    finally:
        handler.forward = eager  # type: ignore[method-assign]


async def _served(
    cfg: Config,
    spec: str,
    corpus: Corpus,
    args: argparse.Namespace,
    count: int,
    *,
    paced: bool = True,
    tag: str = "",
) -> dict[str, Any]:
    """The default command's backlog and (``paced``) half its peak; ``tag`` names its log."""
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    model = f"gputext{run}"
    await create_model_topics(settings, model, _PARTITIONS)
    fleet = _fleet(dataclasses.replace(cfg, model=spec), model, args)
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, args, None, 1)
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        ready_s = time.monotonic() - started
        load = Load(model, run, _PARTITIONS, host, None, 1)
        samplers: list[subprocess.Popen[bytes]] = []

        def sample() -> None:  # --profile-s: py-spy on the first process as the backlog comes
            if args.profile_s:
                samplers.append(sample_first(args, host, f"pyspy-text-{Path(spec).name}"))

        steady = await timed_backlog(args, load, corpus, f"{run}-t", count, sample)
        for sampler in samplers:
            sampler.wait(timeout=args.profile_s + 30)
        served = {
            "ready_s": round(ready_s, 1),
            "processes": len(host.children()) or 1,
            "backlog": count,
            "texts_s": steady["img_s"],
            "gpu_util_pct": steady["gpu_util_pct"],
            "mean_batch": steady["mean_batch"],
            "command": " ".join(host.config.argv()[3:]),
        }
        if not paced:
            return served
        half = await _paced(corpus, args, load, steady["img_s"])
        return served | {
            "half_peak": half,
            "half_peak_met": half["p99_ms"] <= half["latency_bound_ms"],
        }
    finally:
        (args.out / f"text-{Path(spec).name}{tag}.log").write_text(fleet.logs())
        await fleet.aclose()
        await delete_model_topics(settings, model)
