"""Text models in one process: the tokenizer alone, batching by tokens against padding to
the longest text of a fixed count, and the forward alone over the same batches.

    python -m bench.text [--device cpu|cuda] [--texts 2000] [--quick] [--out DIR]

- models, random weights (nothing is downloaded): a BERT-base-sized classifier (12
  layers, width 768) and a MiniLM-sized mean-pooled embedder (6 layers, width 384);
  ``--quick``: one tiny model (2 layers, width 32), for a smoke run.
- tokenizer: a WordPiece vocabulary trained here on the docstrings of Python's
  standard library; texts are made by a rule: words of that corpus in order, a text
  of ``n`` words with ``n`` drawn from a log-normal of median 30 words, so lengths run
  long-tailed from 8 to 512 tokens (the report gives their median and p99).
- per model, on the same texts: ``tokenize`` (the handler's ``preprocess_batch`` in
  chunks of 64, the decode threads' call); ``tokens`` (the worker's batches: the
  ``Batcher`` with the handler's cost, ``--max-batch-tokens``, length buckets);
  ``count`` (batches of ``--max-batch-size`` in arrival order, each padded to its
  longest text); and ``forward`` (the token batches' forward alone, already collated:
  the ceiling of the ``tokens`` row). Texts/s, real tokens/s, and the share of the
  computed tokens that are padding; then milliseconds per token batch of ``collate``
  (padding, the copy to the device), ``forward`` and ``postprocess`` (the copy back,
  the result documents), each timed alone.

Not end to end: Kafka and Redis are not in it (``bench.gpu`` measures those).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from demo.models.wordpiece import docstrings, train_wordpiece
from schemas import ContentType
from workers.batching.batcher import Batcher
from workers.handlers.tasks.text import MASK, TextModel
from workers.handlers.tasks.text_tasks import SentenceEmbedder, TextClassifier

_SEED = 54
_MODULES = ("json", "pathlib", "collections", "argparse", "logging", "textwrap", "string", "os")
MODELS: dict[str, dict[str, int]] = {
    "bert-base": {"layers": 12, "hidden": 768, "heads": 12, "intermediate": 3072},
    "minilm": {"layers": 6, "hidden": 384, "heads": 12, "intermediate": 1536},
}
QUICK = {"tiny": {"layers": 2, "hidden": 32, "heads": 2, "intermediate": 37}}


def corpus() -> Iterator[str]:
    return docstrings(_MODULES)


def tokenizer(vocab: int) -> Any:
    """A fast BERT tokenizer trained on ``corpus()``."""
    return train_wordpiece(corpus(), vocab, 512)


def texts(count: int) -> list[bytes]:
    """The rule of the module doc: consecutive corpus words, log-normal counts."""
    words = " ".join(corpus()).split()
    rng = np.random.default_rng(_SEED)
    sizes = np.clip(rng.lognormal(np.log(30), 0.8, count), 6, 380).astype(int)
    out, start = [], 0
    for size in sizes:
        if start + size > len(words):
            start = 0
        out.append(" ".join(words[start : start + size]).encode())
        start += size
    return out


def handlers(quick: bool, device: torch.device, dtype: torch.dtype) -> dict[str, TextModel]:
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    tok = tokenizer(8000)
    built: dict[str, TextModel] = {}
    for name, size in (QUICK if quick else MODELS).items():
        settings: dict[str, Any] = {"num_labels": 3, "attn_implementation": "sdpa"}
        config = BertConfig(
            vocab_size=len(tok), hidden_size=size["hidden"], num_hidden_layers=size["layers"],
            num_attention_heads=size["heads"], intermediate_size=size["intermediate"],
            max_position_embeddings=512, **settings,
        )  # fmt: skip
        common: dict[str, Any] = {"max_length": 512, "device": device, "dtype": dtype}
        if name == "minilm":
            built[name] = SentenceEmbedder(
                BertModel(config, add_pooling_layer=False), tok, name=name, version=name, **common
            )
        else:
            labels = ["a", "b", "c"]
            module = BertForSequenceClassification(config)
            built[name] = TextClassifier(
                module, tok, labels=labels, name=name, version=name, **common
            )
    return built


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def token_batches(
    handler: TextModel, items: Sequence[torch.Tensor], budget: int, count: int
) -> list[list[torch.Tensor]]:
    batcher: Batcher[torch.Tensor] = Batcher(count, 0.0, cost_of=handler.cost, max_cost=budget)
    batcher.add_many(items, 0.0)
    return [batch.items for batch in batcher.drain(0.0)]


def _one_per_shape(
    handler: TextModel, batches: Sequence[Sequence[torch.Tensor]]
) -> list[Sequence[torch.Tensor]]:
    """The first batch of each (rows, padded length) among ``batches``."""
    seen: dict[tuple[int, int], Sequence[torch.Tensor]] = {}
    for batch in batches:
        width = max(handler.cost(item) for item in batch)
        seen.setdefault((len(batch), width), batch)
    return list(seen.values())


def run_batches(handler: TextModel, batches: Sequence[Sequence[torch.Tensor]]) -> tuple[float, int]:
    """Seconds for collate + forward + postprocess of every batch; tokens computed."""
    computed = 0
    device = handler.device
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            collated = handler.collate(batch, device)
            handler.postprocess(handler.forward(collated), [{}] * len(batch))
            computed += int(collated.shape[0] * collated.shape[-1])
    _sync(device)
    return time.perf_counter() - start, computed


def stages(handler: TextModel, batches: Sequence[Sequence[torch.Tensor]]) -> dict[str, float]:
    """Milliseconds per batch of ``collate``, ``forward`` and ``postprocess`` apart: the
    device synchronized after each, so the three add up to more than ``run_batches``'s
    pipelined time, but each says what it costs alone."""
    spent = {"collate": 0.0, "forward": 0.0, "postprocess": 0.0}
    device = handler.device
    with torch.inference_mode():
        for batch in batches:
            start = time.perf_counter()
            collated = handler.collate(batch, device)
            _sync(device)
            collated_at = time.perf_counter()
            outputs = handler.forward(collated)
            _sync(device)
            forward_at = time.perf_counter()
            handler.postprocess(outputs, [{}] * len(batch))
            _sync(device)
            spent["collate"] += collated_at - start
            spent["forward"] += forward_at - collated_at
            spent["postprocess"] += time.perf_counter() - forward_at
    return {stage: 1000 * seconds / len(batches) for stage, seconds in spent.items()}


def forward_only(handler: TextModel, batches: Sequence[Sequence[torch.Tensor]]) -> float:
    collated = [handler.collate(batch, handler.device) for batch in batches]
    _sync(handler.device)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in collated:
            handler.forward(batch)
    _sync(handler.device)
    return time.perf_counter() - start


def measure(handler: TextModel, payloads: list[bytes], budget: int, count: int) -> dict[str, Any]:
    chunks = [payloads[i : i + 64] for i in range(0, len(payloads), 64)]
    start = time.perf_counter()
    items: list[torch.Tensor] = []
    for chunk in chunks:
        done = handler.preprocess_batch(chunk, [ContentType.TEXT] * len(chunk), [{}] * len(chunk))
        items += [item for item in done if isinstance(item, torch.Tensor)]
    tokenize_s = time.perf_counter() - start
    lengths = np.array([int(item[MASK].sum()) for item in items])
    real = int(lengths.sum())
    by_tokens = token_batches(handler, items, budget, count)
    by_count = [items[i : i + count] for i in range(0, len(items), count)]
    # Warm-up: one batch of every shape each row computes, so that no row pays the
    # first call of a shape (the allocator's growth, CUDA's lazy kernel loading, the
    # GEMM heuristics) that a later row then gets for free.
    run_batches(handler, _one_per_shape(handler, by_tokens))
    report: dict[str, Any] = {
        "texts": len(items),
        "tokens_median": float(np.median(lengths)),
        "tokens_p99": float(np.percentile(lengths, 99)),
        "tokens_max": int(lengths.max()),
        "tokenize": {"texts_per_s": len(items) / tokenize_s, "tokens_per_s": real / tokenize_s},
    }
    buckets = handler.buckets
    for name, batches, padded in (("tokens", by_tokens, buckets), ("count", by_count, None)):
        # Padding to the longest text: every length its own bucket.
        handler.buckets = buckets if padded else tuple(range(1, handler.max_length + 1))
        if not padded:
            run_batches(handler, _one_per_shape(handler, batches))
        seconds, computed = run_batches(handler, batches)
        report[name] = {
            "batches": len(batches),
            "texts_per_s": len(items) / seconds,
            "tokens_per_s": real / seconds,
            "padded_share": 1 - real / computed,
        }
    handler.buckets = buckets
    seconds = forward_only(handler, by_tokens)
    report["forward"] = {"texts_per_s": len(items) / seconds, "tokens_per_s": real / seconds}
    report["stages_ms"] = stages(handler, by_tokens)
    report["tokens_over_count"] = report["tokens"]["texts_per_s"] / report["count"]["texts_per_s"]
    return report


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def _print(name: str, found: dict[str, Any]) -> None:
    median, p99 = found["tokens_median"], found["tokens_p99"]
    print(f"{name}: {found['texts']} texts, median {median:.0f} tokens, p99 {p99:.0f}")
    for row in ("tokenize", "tokens", "count", "forward"):
        values = found[row]
        padded = f", padding {values['padded_share']:.0%}" if "padded_share" in values else ""
        rate, tokens = values["texts_per_s"], values["tokens_per_s"]
        print(f"  {row:9} {rate:9.1f} texts/s {tokens:11.0f} tokens/s{padded}")
    ms = found["stages_ms"]
    print(
        f"  per token batch ({found['tokens']['batches']}): collate {ms['collate']:.2f} ms, "
        f"forward {ms['forward']:.2f} ms, postprocess {ms['postprocess']:.2f} ms"
    )
    print(f"  tokens / count: {found['tokens_over_count']:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.text", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--max-batch-tokens", type=int, default=16_384)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="a tiny model and 200 texts")
    parser.add_argument("--out", type=Path, default=None, help="folder for text-bench.json")
    args = parser.parse_args(argv)
    torch.manual_seed(_SEED)
    device = torch.device(args.device)
    payloads = texts(200 if args.quick else args.texts)
    report: dict[str, Any] = {
        "device": _device_name(device),
        "cpus": torch.get_num_threads(),
        "dtype": args.dtype,
        "max_batch_tokens": args.max_batch_tokens,
        "max_batch_size": args.max_batch_size,
        "models": {},
    }  # fmt: skip
    dtype = getattr(torch, args.dtype)
    for name, handler in handlers(args.quick, device, dtype).items():
        found = measure(handler, payloads, args.max_batch_tokens, args.max_batch_size)
        report["models"][name] = found
        _print(name, found)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "text-bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
