"""Half precision against float32 for text models, on real text: what ``--dtype auto``
runs ``hf:`` text models in on a GPU rests on it.

    python -m bench.text_agreement [--device cuda] [--steps 400] [--quick] [--out DIR]

- **Text**: the lines of the docstrings of eight modules of Python's standard library
  (English written by people, shipped with every Python), each labelled by its module;
  a line is held out when its hash says so (a fifth).
- **Models**, trained here from random weights, so that the weights and margins are
  those of a trained model rather than noise (nothing is downloaded): ``bench.text``'s
  BERT-base-sized classifier (12 layers, width 768), trained in float32 for
  ``--steps`` steps on the other four fifths to tell the module from the line; and its
  encoder saved bare, which ``hf:`` serves as a mean-pooled sentence embedder. Besides
  them ``bench.text``'s MiniLM-sized embedder with random weights.
- **Served**: each folder is loaded as the worker loads ``hf:FOLDER`` (``load_handler``)
  once in float32 and once in each of ``--dtypes``, and the held-out lines go through the
  handler's tokenizer, collate, forward and device post-processing in batches of 64.
- **Reported**: the classifier's held-out accuracy; top-1 agreement of each half
  precision with float32 and the largest difference of a probability; each embedder's
  cosine between the half-precision and float32 vector of each line (mean, minimum,
  1st percentile). The goals (issue 54): top-1 agreement >= 99%, cosine >= 0.999.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import text as text_bench
from demo.models.wordpiece import docstrings
from schemas import DEFAULT_LIMITS, ContentType
from workers.handlers.tasks.text import TextModel
from workers.handlers.tasks.text_tasks import SentenceEmbedder, TextClassifier
from workers.model.loader import load_handler

_MODULES = ("json", "pathlib", "collections", "argparse", "logging", "textwrap", "string", "os")
_BATCH = 64
_HELD_OUT = 5  # one line in this many


def labelled_lines() -> tuple[list[str], list[int]]:
    """Distinct docstring lines of at least four words, each with its module's index."""
    seen: set[str] = set()
    lines, labels = [], []
    for index, name in enumerate(_MODULES):
        for line in docstrings([name]):
            if len(line.split()) >= 4 and line not in seen:
                seen.add(line)
                lines.append(line)
                labels.append(index)
    return lines, labels


def held_out(line: str) -> bool:
    return zlib.crc32(line.encode()) % _HELD_OUT == 0


def train(folder: Path, size: dict[str, int], steps: int, device: torch.device) -> dict[str, Any]:
    """The classifier trained on the lines not held out, saved with its tokenizer to
    ``folder/classifier`` and its encoder alone to ``folder/encoder``."""
    from transformers import BertConfig, BertForSequenceClassification

    lines, labels = labelled_lines()
    train_rows = [(t, y) for t, y in zip(lines, labels, strict=True) if not held_out(t)]
    tokenizer = text_bench.tokenizer(8000)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], intermediate_size=size["intermediate"],
        max_position_embeddings=512, num_labels=len(_MODULES),
        id2label=dict(enumerate(_MODULES)), label2id={m: i for i, m in enumerate(_MODULES)},
    )  # fmt: skip
    torch.manual_seed(54)
    model = BertForSequenceClassification(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * max(0.05, 1 - step / steps)
    )
    rng = np.random.default_rng(54)
    started = time.perf_counter()
    for _ in range(steps):
        rows = [train_rows[i] for i in rng.integers(0, len(train_rows), 32)]
        batch = tokenizer(
            [t for t, _ in rows], padding=True, truncation=True, max_length=128,
            return_tensors="pt",
        ).to(device)  # fmt: skip
        target = torch.tensor([y for _, y in rows], device=device)
        loss = model(**batch, labels=target).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    trained_s = time.perf_counter() - started
    model.eval().cpu()
    model.save_pretrained(folder / "classifier")
    tokenizer.save_pretrained(folder / "classifier")
    model.bert.config.architectures = ["BertModel"]
    model.bert.save_pretrained(folder / "encoder")
    tokenizer.save_pretrained(folder / "encoder")
    return {"train_lines": len(train_rows), "steps": steps, "trained_s": trained_s}


def served(
    spec: str, payloads: Sequence[bytes], device: torch.device, dtype: str, weights: str | None
) -> torch.Tensor:
    """What the worker computes for each payload, in order: a classifier's probabilities
    (in label order), an embedder's pooled vectors (its post-processing's device half)."""
    torch.manual_seed(0)  # the same random weights for every dtype
    handler = load_handler(
        spec, device=str(device), weights=weights, dtype=dtype, channels_last=None,
        limits=DEFAULT_LIMITS,
    )  # fmt: skip
    assert isinstance(handler, TextModel)
    out = []
    with torch.inference_mode():
        for start in range(0, len(payloads), _BATCH):
            chunk = payloads[start : start + _BATCH]
            kinds = [ContentType.TEXT] * len(chunk)
            items = handler.preprocess_batch(chunk, kinds, [{}] * len(chunk))
            tensors = [item for item in items if isinstance(item, torch.Tensor)]
            assert len(tensors) == len(chunk), "every line is a text the handler takes"
            outputs = handler.forward(handler.collate(tensors, device))
            if isinstance(handler, TextClassifier):
                values = outputs.values.float().softmax(dim=-1)
            else:
                assert isinstance(handler, SentenceEmbedder)
                values = handler.postprocess_device(outputs, [{}] * len(chunk))[0]
            out.append(values.float().cpu())
    return torch.cat(out)


def agreement(reference: torch.Tensor, other: torch.Tensor, classifier: bool) -> dict[str, float]:
    if classifier:
        same = (reference.argmax(dim=1) == other.argmax(dim=1)).float()
        return {
            "top1_agreement": float(same.mean()),
            "largest_probability_difference": float((reference - other).abs().max()),
        }
    cosine = torch.nn.functional.cosine_similarity(reference.double(), other.double(), dim=1)
    return {
        "cosine_mean": float(cosine.mean()),
        "cosine_min": float(cosine.min()),
        "cosine_p01": float(torch.quantile(cosine, 0.01)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.text_agreement", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 20 steps")
    parser.add_argument("--folder", type=Path, default=Path(".run") / "text-agreement")
    parser.add_argument("--out", type=Path, default=None, help="folder for text-agreement.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = text_bench.QUICK if args.quick else text_bench.MODELS
    trained = train(
        args.folder, next(iter(sizes.values())), 20 if args.quick else args.steps, device
    )
    lines, labels = labelled_lines()
    test = [(t, y) for t, y in zip(lines, labels, strict=True) if held_out(t)]
    payloads = [t.encode() for t, _ in test]
    truth = torch.tensor([y for _, y in test])
    random_folder = args.folder / "random-embedder"
    from bench.gpu.text import write_folder

    random_spec = f"hf:{write_folder('tiny' if args.quick else 'minilm', random_folder)}"
    models = {
        "classifier": (f"hf:{args.folder / 'classifier'}", None),
        "trained-encoder": (f"hf:{args.folder / 'encoder'}", None),
        "random-embedder": (random_spec, "random"),
    }
    report: dict[str, Any] = {
        "device": text_bench._device_name(device),
        "held_out_lines": len(test),
        "modules": list(_MODULES),
        "training": trained,
        "models": {},
    }
    for name, (spec, weights) in models.items():
        reference = served(spec, payloads, device, "float32", weights)
        row: dict[str, Any] = {}
        if name == "classifier":
            right = reference.argmax(dim=1) == truth
            row["held_out_accuracy_float32"] = float(right.float().mean())
        for dtype in filter(None, args.dtypes.split(",")):
            other = served(spec, payloads, device, dtype, weights)
            row[dtype] = agreement(reference, other, name == "classifier")
        report["models"][name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "text-agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
