"""bench.generate: the generation engine against transformers' static-batched ``generate``.

One call on one card measures, for each number of requests in flight (``--in-flight``,
default 64 and 256), on the same prompts of mixed lengths and mixed output lengths:

- output tokens/s of the engine (``workers.generation.engine``: continuous batching, a
  new request joining as soon as one leaves) and of ``model.generate`` on static
  batches of that many prompts (left-padded, every batch running until its longest
  output; only the tokens asked for count), and their ratio;
- the decode roofline at that batch: HBM bandwidth over the bytes one decode step reads
  (the weights once, and each sequence's KV cache at its mean length), times the batch,
  in tokens/s; and the fraction of it the engine reached;
- time to first token and between tokens, p50 and p99, with requests arriving at half
  the engine's peak request rate (open loop, Poisson arrivals).

The model is built from a config with random weights (``--config llama-1b``: the shape
of Llama-3.2-1B, bfloat16 on a GPU), nothing is downloaded, and end-of-sequence is off
so that every output has the length asked for. ``--device cpu --quick`` runs a tiny
model through every step in seconds (the unit tests run it, so this file cannot rot).

``--variants`` names engine variants (``VARIANTS``) measured one after another in the
same run against one static baseline per level: each builds its own ``Engine``.

    python -m bench.generate --out bench/gpu-runs/generate.json        # on an H200
    python -m bench.generate --device cpu --quick --out /tmp/gen.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.stats import percentile
from workers.generation.engine import Engine, EngineOptions
from workers.generation.requests import Prompt, Sampling

log = logging.getLogger("bench.generate")

H200_HBM_GBPS = 4800.0  # H200 SXM: 4.8 TB/s

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-1b": {  # Llama-3.2-1B's shape
        "vocab_size": 128_256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    },
}


VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # the engine's defaults: the manager decides graphs and async batching
    "graphs": {"cuda_graphs": True, "async_batching": True},
    "graphs-sync": {"cuda_graphs": True, "async_batching": False},
    "eager-attn": {"attention": "paged|eager"},
    "no-cudnn": {"cudnn_attention": False},  # attention without cuDNN's kernel
}


@dataclass(frozen=True, slots=True)
class Work:
    prompt: list[int]
    new_tokens: int


def workload(
    count: int, vocab: int, prompts: tuple[int, int], outputs: tuple[int, int], seed: int
) -> list[Work]:
    """``count`` requests: prompt and output lengths uniform in their ranges, seeded."""
    rng = random.Random(seed)
    return [
        Work(
            [rng.randrange(3, vocab) for _ in range(rng.randint(*prompts))],
            rng.randint(*outputs),
        )
        for _ in range(count)
    ]


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIGS[name], eos_token_id=None, bos_token_id=1, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


@dataclass(slots=True)
class Timed:
    created_s: float
    stamps: list[float]


async def run_engine(
    engine: Engine, works: Sequence[Work], in_flight: int, rate_per_s: float | None
) -> tuple[float, list[Timed]]:
    """Seconds to generate ``works`` and each one's token times: closed loop with
    ``in_flight`` at a time, or open loop at ``rate_per_s`` (Poisson) when given."""
    done: list[Timed] = []
    slots = asyncio.Semaphore(in_flight)
    finished = asyncio.Event()
    rng = random.Random(1)
    greedy = Sampling()

    def add(work: Work, n: int) -> None:
        def on_output(output: Any) -> None:
            if output.is_finished():
                done.append(Timed(output.created_time, list(output.timestamps or [])))
                slots.release()
                if len(done) == len(works):
                    finished.set()

        engine.add(f"b{n}", Prompt(work.prompt, work.new_tokens, greedy), on_output)

    start = time.perf_counter()
    for n, work in enumerate(works):
        if rate_per_s is None:
            await slots.acquire()
        else:
            await asyncio.sleep(rng.expovariate(rate_per_s))
            await slots.acquire()  # never more than the engine's size in flight
        add(work, n)
    await finished.wait()
    return time.perf_counter() - start, done


def run_static(model: Any, works: Sequence[Work], batch: int, device: torch.device) -> float:
    """Seconds for ``model.generate`` over static batches of ``batch`` prompts."""
    start = time.perf_counter()
    for first in range(0, len(works), batch):
        group = works[first : first + batch]
        longest = max(len(w.prompt) for w in group)
        ids = torch.zeros((len(group), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, w in enumerate(group):  # left padding, as generation needs
            ids[row, longest - len(w.prompt) :] = torch.tensor(w.prompt)
            mask[row, longest - len(w.prompt) :] = 1
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(w.new_tokens for w in group),
                min_new_tokens=max(w.new_tokens for w in group),
                do_sample=False,
                pad_token_id=0,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def roofline(model: Any, works: Sequence[Work], batch: int, hbm_gbps: float) -> dict[str, float]:
    """Decode tokens/s at ``batch`` if every step only read memory at ``hbm_gbps``."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    heads = config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    size = torch.empty((), dtype=model.dtype).element_size()
    per_token = 2 * config.num_hidden_layers * heads * head_dim * size
    mean_context = statistics.fmean(len(w.prompt) + w.new_tokens / 2 for w in works)
    step_bytes = weights + batch * mean_context * per_token
    return {
        "bytes_per_step": step_bytes,
        "weights_bytes": weights,
        "kv_bytes_per_step": batch * mean_context * per_token,
        "tokens_per_s": hbm_gbps * 1e9 / step_bytes * batch,
    }


def latencies(timed: Sequence[Timed]) -> dict[str, float]:
    ttft = [(t.stamps[0] - t.created_s) * 1000.0 for t in timed if t.stamps]
    gaps = [(b - a) * 1000.0 for t in timed for a, b in zip(t.stamps, t.stamps[1:], strict=False)]
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "tbt_p50_ms": percentile(gaps, 50),
        "tbt_p99_ms": percentile(gaps, 99),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.config, device, dtype)
    vocab = model.config.vocab_size
    report: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "config": args.config,
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters()),
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "hbm_gbps": args.hbm_gbps,
        },
        "levels": [],
    }
    for in_flight in args.in_flight:
        works = workload(
            in_flight * args.rounds, vocab, args.prompt_tokens, args.output_tokens, in_flight
        )
        useful = sum(w.new_tokens for w in works)
        static_s = run_static(model, works, in_flight, device)
        roof = roofline(model, works, in_flight, args.hbm_gbps)
        for variant in args.variants:
            level = measure_variant(model, works, in_flight, variant, args)
            engine_tps = level["engine_tokens_per_s"]
            level.update(
                static_tokens_per_s=useful / static_s,
                engine_over_static=engine_tps / (useful / static_s),
                roofline_tokens_per_s=roof["tokens_per_s"],
                roofline_fraction=engine_tps / roof["tokens_per_s"],
                roofline=roof,
            )
            log.info(
                "%s in_flight=%d engine %.0f tok/s static %.0f (%.2fx) tbt p50 %.1f ms",
                variant,
                in_flight,
                engine_tps,
                useful / static_s,
                level["engine_over_static"],
                level["half_peak"]["tbt_p50_ms"],
            )
            report["levels"].append(level)
    return report


def measure_variant(
    model: Any, works: Sequence[Work], in_flight: int, variant: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine variant over ``works``: peak tokens/s, then latencies at half its rate."""
    useful = sum(w.new_tokens for w in works)
    attention = model.config._attn_implementation
    options = EngineOptions(
        max_sequences=in_flight, kv_cache_mb=args.kv_cache_mb, **VARIANTS[variant]
    )
    engine = Engine(model, [], options)
    engine.start()
    try:
        asyncio.run(run_engine(engine, works[: min(len(works), in_flight)], in_flight, None))
        seconds, _ = asyncio.run(run_engine(engine, works, in_flight, None))
        request_rate = len(works) / seconds
        half, timed = asyncio.run(run_engine(engine, works, in_flight, request_rate / 2))
    finally:
        engine.stop()
        model.set_attn_implementation(attention)  # the next variant starts from the same
    return {
        "variant": variant,
        "in_flight": in_flight,
        "requests": len(works),
        "output_tokens": useful,
        "engine_tokens_per_s": useful / seconds,
        "kv_plan": engine.plan.describe(),
        "half_peak": {"requests_per_s": request_rate / 2, "seconds": half, **latencies(timed)},
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="llama-1b")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=4, help="requests = in-flight x rounds")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="the cache's size on the CPU")
    parser.add_argument("--hbm-gbps", type=float, default=H200_HBM_GBPS)
    parser.add_argument(
        "--variants",
        type=lambda v: v.split(","),
        default=["default"],
        help=f"engine variants, comma-separated, of {sorted(VARIANTS)}",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few requests")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from {sorted(VARIANTS)}")
    if args.quick:
        args.config, args.in_flight, args.rounds = "tiny", [4], 2
        args.prompt_tokens, args.output_tokens = (4, 24), (4, 12)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse(argv)
    report = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
