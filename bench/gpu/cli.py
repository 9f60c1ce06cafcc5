"""The command line of ``python -m bench.gpu``: options, stages, results written as they come.

The stages chosen (with their letters a-d) run in turn, the results written to
``gpu-bench.json`` after every stage and layout (merged with ``--previous`` files),
then the plot and the table. The load's producer processes run ``python -m
bench.gpu.load`` (no torch, so they start in a second).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, get_args

import torch

import bench.gpu
from bench.detect import DETECTORS, print_detect_table, stage_detect
from bench.gpu.accept import FORMS, ceiling_share, print_accept_table, stage_accept
from bench.gpu.ceilings import stage_checks, stage_decode, stage_forward, stage_naive, stage_overlap
from bench.gpu.chain import CHAIN, stage_chain
from bench.gpu.config import Config, _card, load_model, make_config
from bench.gpu.corpus import Corpus, build_corpora
from bench.gpu.e2e import stage_e2e
from bench.gpu.host import stage_kill, stage_ready
from bench.gpu.lone import LONE_MODELS, VARIANTS, stage_lone
from bench.gpu.model_stage import _detect_pipeline, stage_pipeline
from bench.gpu.report import plot, print_table, summarize
from bench.gpu.streams import STREAM_P99_BOUND_MS
from bench.gpu.text import TEXT_MODELS, stage_text
from bench.gpu.together import TOGETHER, stage_together
from bench.gpu.zoo import ZOO, stage_zoo
from workers.decode.gpu import DecodeOption
from workers.decode.images import ImageSpec

STAGES = (
    "forward",
    "decode",
    "overlap",
    "naive",
    "checks",
    "pipeline",
    "e2e",
    "ready",
    "kill",
    "detect",
    "accept",
    "zoo",
    "together",
    "chain",
    "lone",
    "text",
)
_ALIASES = {"a": "forward", "b": "decode", "c": "naive", "d": "e2e", "runner": "pipeline"}
RESULTS_FILE = "gpu-bench.json"
PLOT_FILE = "gpu-bench.png"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    # The package's docstring describes the command; its first line is the description.
    description = (bench.gpu.__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=description)
    parser.add_argument(
        "--stages",
        default="forward,decode,naive,checks,runner,e2e",
        help=f"comma-separated: {', '.join(STAGES)} (or a, b, c, d)",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: smoke test)")
    parser.add_argument(
        "--corpora", default="640x480,224x224", help="image sizes WxH, comma-separated"
    )
    parser.add_argument("--model", default="torchvision:resnet50")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile (always on a GPU, unless --worker-options has --no-compile)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny counts: checks that it runs")
    parser.add_argument("--iterations", type=int, default=30, help="timed forwards per size")
    parser.add_argument(
        "--forward-batches", default="1,32,128,256", help="forward stage: batch sizes timed"
    )
    parser.add_argument(
        "--mps",
        choices=("auto", "on", "off"),
        default="auto",
        help="e2e, kill, ready: the command's --mps (auto: its own MPS server for cards with "
        "several processes)",
    )
    parser.add_argument(
        "--profile",
        choices=("throughput", "latency"),
        default="throughput",
        help="e2e: the command's --profile",
    )
    parser.add_argument(
        "--compile-cache",
        type=Path,
        help="e2e, kill: the command's --compile-cache (default: its own default folder)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--e2e-count", type=int, default=24576, help="backlog per repeat")
    parser.add_argument("--kafka-bootstrap", help="broker for e2e; e2e is skipped without it")
    parser.add_argument("--redis-url", help="Redis for e2e; e2e is skipped without it")
    parser.add_argument(
        "--partitions",
        type=int,
        default=0,
        help="e2e: partitions of the request topic (default: one for each process)",
    )
    parser.add_argument(
        "--worker-decode",
        default="auto",
        choices=[*get_args(DecodeOption), "both"],
        help="e2e: the command's --decode (auto: its default, nvJPEG on CUDA; both: half of "
        "each card's processes on the hardware engine)",
    )
    parser.add_argument(
        "--e2e-configs",
        default="autox1",
        help="e2e layouts, comma-separated PROCESSESxCARDS: autox1 (the command's own count "
        "on one card), autox2, 8x1 (eight processes on one card), 1x1",
    )
    parser.add_argument(
        "--ready-processes",
        default="1,auto",
        help="ready: processes on one card to time the start of, cold and warm",
    )
    parser.add_argument("--repeats", type=int, default=3, help="e2e backlogs per layout")
    parser.add_argument("--producers", type=int, default=8, help="e2e producer processes")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin broker and Redis, the producers and the workers to cores of their own",
    )
    parser.add_argument("--metrics-port", type=int, default=19400, help="the host's port")
    parser.add_argument(
        "--worker-options",
        default="",
        help="more flags for every e2e worker, e.g. '--no-cuda-graphs'",
    )
    parser.add_argument(
        "--profile-s",
        type=float,
        default=0.0,
        help="e2e: sample the first worker with py-spy for this long (see --profile-phase); "
        "zoo: each model's first worker as its backlog comes; chain: a classifier process "
        "serving the crops alone",
    )
    parser.add_argument(
        "--profile-phase",
        default="backlog",
        choices=("backlog", "paced"),
        help="--profile-s samples the second backlog (throughput) or the paced load (latency)",
    )
    parser.add_argument(
        "--profile-gil",
        action="store_true",
        help="--profile-s samples only the thread holding the GIL (who keeps the others waiting)",
    )
    parser.add_argument(
        "--accept-forms",
        default=",".join(FORMS),
        help="accept: the compile forms to run the default command with",
    )
    parser.add_argument(
        "--accept-cards",
        default="",
        help="accept: the numbers of cards to run each form on, e.g. 1,4 (default: one, "
        "the powers of two below the host's count, and all of them)",
    )
    parser.add_argument("--zoo", default=",".join(ZOO), help="zoo: model specs, comma-separated")
    parser.add_argument(
        "--text-models",
        default=",".join(TEXT_MODELS),
        help="text: bench.text's models, comma-separated (tiny: a smoke run)",
    )
    parser.add_argument(
        "--text-variants",
        default="",
        help="text: more worker flags to serve each model with after its default command, "
        "';'-separated (e.g. '--no-compile;--processes 4'): a backlog each, no paced load",
    )
    parser.add_argument(
        "--lone-models", default=",".join(LONE_MODELS), help="lone: model specs, comma-separated"
    )
    parser.add_argument(
        "--lone-variants",
        default=",".join(VARIANTS),
        help=f"lone: the command's variants, comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--lone-requests", type=int, default=200, help="lone: requests sent one at a time"
    )
    parser.add_argument("--together", default=TOGETHER, help="together: two model specs")
    parser.add_argument(
        "--together-s", type=float, default=6.0, help="together: seconds each backlog lasts alone"
    )
    parser.add_argument(
        "--together-refused",
        type=int,
        default=64,
        help="together: processes the second model asks for in the last host (more than fit)",
    )
    parser.add_argument(
        "--chain", default=CHAIN, help="chain: a detector spec and a classifier spec"
    )
    parser.add_argument(
        "--chain-boxes", type=int, default=4, help="chain: boxes an image sent to the classifier"
    )
    parser.add_argument(
        "--chain-s",
        type=float,
        default=6.0,
        help="chain: seconds a backlog lasts the detector alone",
    )
    parser.add_argument(
        "--chain-crops",
        type=int,
        default=16384,
        help="chain: the classifier's backlog alone, the pipeline's crops sent again as often",
    )
    parser.add_argument(
        "--chain-detector",
        help="chain: the detector spec, in place of --chain's first (e.g. an hf: detector)",
    )
    parser.add_argument(
        "--chain-detector-options",
        help="chain: the detector's model_options as an inline TOML table (default: a "
        "torchvision detector keeps every box, others none)",
    )
    parser.add_argument(
        "--chain-streams",
        type=int,
        default=64,
        help="chain: camera streams sent through the pipeline's host, paced (0: none)",
    )
    parser.add_argument(
        "--chain-fps", type=float, default=30.0, help="chain: frames a second of each stream"
    )
    parser.add_argument(
        "--chain-streams-s", type=float, default=8.0, help="chain: seconds the streams run"
    )
    parser.add_argument(
        "--stream-p99-bound-ms",
        type=float,
        default=STREAM_P99_BOUND_MS,
        help="chain: the bound on every stream's p99 frame latency, written down before "
        "the run (default three frame intervals at 30 frames/s: bench/gpu/streams.py)",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument(
        "--request-params",
        type=_json_object,
        default={},
        help="a JSON object every produced request carries as its parameters (e2e, zoo, "
        'acceptance), e.g. \'{"dtype": "float16"}\': an embedding\'s results at half size',
    )
    parser.add_argument("--e2e-timeout", type=float, default=240.0)
    parser.add_argument(
        "--detectors",
        default=",".join(DETECTORS),
        help="detect: comma-separated torchvision detection architectures",
    )
    parser.add_argument("--detect-batch", type=int, default=32, help="detect: batch size")
    parser.add_argument("--paced-s", type=float, default=4.0, help="seconds of paced load")
    parser.add_argument(
        "--paced-warmup-s",
        type=float,
        default=4.0,
        help="seconds of the same paced load first, not measured: a fresh broker's first "
        "paced traffic was acknowledged 21-37 ms late at p99, later ones 3-10 ms",
    )
    parser.add_argument(
        "--paced-max-rate",
        type=float,
        default=math.inf,
        help="cap on the paced rate, whatever half the peak is (rows whose producers "
        "fall behind report no latency); none by default",
    )
    parser.add_argument(
        "--service-cores",
        type=int,
        default=0,
        help="with --pin: cores for the broker and Redis (the last ones; default a "
        "quarter of them, at least two)",
    )
    parser.add_argument(
        "--producer-cores",
        type=int,
        default=0,
        help="with --pin: cores for the producers (before the services'; default a "
        "quarter of them, at least two); the workers get the rest",
    )
    parser.add_argument(
        "--latency-from",
        choices=("append", "due"),
        default="append",
        help="paced latency from the broker's append of each request (its request topic "
        "stamps LogAppendTime) or from the time the producer was due to send it (which "
        "counts the producers' own lag too)",
    )
    parser.add_argument(
        "--previous",
        nargs="*",
        default=[],
        type=Path,
        help="earlier gpu-bench.json files to merge (stages run in other calls)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: merge --previous files, print the table, plot",
    )
    parser.add_argument("--out", type=Path, default=Path(".run/gpu-bench"))
    return parser.parse_args(argv)  # fmt: skip


def _json_object(text: str) -> dict[str, Any]:
    """``--request-params``: a JSON object, else an argparse error saying so."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {type(value).__name__}")
    return value


def selected_stages(text: str, args: argparse.Namespace) -> list[str]:
    stages = [_ALIASES.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
    for stage in ("e2e", "ready", "kill", "lone", "text"):
        if stage in stages and not (args.kafka_bootstrap and args.redis_url):
            print(f"{stage} skipped: it needs --kafka-bootstrap and --redis-url", flush=True)
            stages.remove(stage)
    return stages


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    for previous in args.previous:
        for key, value in json.loads(previous.read_text()).items():
            if key in ("e2e", "pipeline", "overlap", "stage_s") and key in results:
                results[key].update(value)  # layouts and paths measured in several calls
            else:
                results[key] = value
    if not args.report:
        os.environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", str(Path(".cache/torchinductor").resolve())
        )
        cfg = make_config(args)
        stages = selected_stages(args.stages, args)
        corpora = build_corpora(cfg.distinct_images, args.corpora.split(","))
        spec = load_model(cfg, "float32").image
        results["meta"] = {
            "card": _card(cfg.device),
            "model": cfg.model,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv),
            "weights": "random (throughput only; outputs are meaningless)",
            "corpus_kb": {c.name: c.mean_kb for c in corpora},
        }
        for stage in stages:
            print(f"stage {stage}", flush=True)
            started = time.perf_counter()
            save = partial(_save_partial, results, stage, args.out)
            results[stage] = _run_stage(stage, cfg, corpora, spec, args, save)
            results.setdefault("stage_s", {})[stage] = time.perf_counter() - started
            _save_partial(results, stage, args.out, results[stage])
    card = results.get("meta", {}).get("card", "?")
    model = results.get("meta", {}).get("model", "?")
    rows = summarize(results)
    results["summary"] = rows
    _write_results(results, args.out)
    plot(results, rows, args.out / PLOT_FILE, card)
    print_detect_table(results, card)
    print_table(rows, card, model)
    if "accept" in results:
        ceiling_share(results["accept"], results, cfg.max_batch if not args.report else 256)
        _write_results(results, args.out)
        print_accept_table(results["accept"], card)
        runs = results["accept"]["runs"].values()
        return 0 if runs and all(r["passed"] for r in runs) else 1
    return 0


def _write_results(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str))


def _save_partial(results: dict[str, Any], stage: str, out: Path, rows: dict[str, Any]) -> None:
    """The results so far, ``stage`` with ``rows``: a run stopped by a time limit keeps
    every stage and layout it finished (``--previous`` merges them into a later run)."""
    _write_results(results | {stage: rows}, out)


def _run_stage(
    stage: str,
    cfg: Config,
    corpora: Sequence[Corpus],
    spec: ImageSpec,
    args: argparse.Namespace,
    save: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    simple: dict[str, Callable[[], dict[str, Any]]] = {
        "forward": lambda: stage_forward(cfg),
        "decode": lambda: stage_decode(cfg, corpora, spec),
        "naive": lambda: stage_naive(cfg, corpora),
        "checks": lambda: stage_checks(cfg, corpora),
        "pipeline": lambda: stage_pipeline(cfg, corpora),
        "overlap": lambda: stage_overlap(cfg, corpora),
        "kill": lambda: stage_kill(cfg, corpora, args),
        "ready": lambda: stage_ready(cfg, args),
        "accept": lambda: stage_accept(cfg, corpora, args),
        "zoo": lambda: stage_zoo(cfg, corpora, args, save),
        "together": lambda: stage_together(cfg, corpora, args),
        "chain": lambda: stage_chain(cfg, corpora, args),
        "lone": lambda: stage_lone(cfg, corpora, args, save),
        "text": lambda: stage_text(cfg, corpora, args, save),
    }
    if stage in simple:
        return simple[stage]()
    if stage == "detect":
        return stage_detect(
            str(cfg.device),
            [arch.strip() for arch in args.detectors.split(",") if arch.strip()],
            corpora[0].payloads,  # 640x480
            naive_count=max(cfg.naive_count // 10, 2),
            pipeline_count=max(cfg.runner_count // 10, 4),
            batch=args.detect_batch if not args.quick else 2,
            threads=cfg.threads,
            quick=args.quick,
            run_pipeline=functools.partial(_detect_pipeline, cfg),
        )
    return stage_e2e(cfg, corpora, args, save)
