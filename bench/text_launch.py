"""What a text batch costs the host: a BERT-base-sized encoder's forward, eager and
compiled, as CPU time spent launching it and as wall time to its end, by batch shape.

A worker's model thread shares its cores with the tokenizer (``bench.gpu --stages
text``): a forward whose launch costs more CPU than its kernels take on the card leaves
the card waiting and takes the core from tokenizing. Each forward starts on an idle
card, so its CPU time is the launch alone; one process on one core, random weights,
float16, attention without cuDNN (as ``workers.handlers.tasks.text`` runs it), the
second half of the rows padded to half the length.

    python -m bench.text_launch [--core N] [--shapes 16x64,32x64,...]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

SHAPES = "16x64,32x64,150x64,32x128,256x48"
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def timed(forward: Forward, rows: int, length: int, runs: int = 20) -> tuple[float, float]:
    """Mean CPU ms to launch one forward, and mean wall ms to its end."""
    ids = torch.randint(0, 30_000, (rows, length), device="cuda")
    mask = torch.ones_like(ids)
    mask[rows // 2 :, length // 2 :] = 0
    cpu = wall = 0.0
    with torch.inference_mode():
        for _ in range(3):
            forward(ids, mask)
        torch.cuda.synchronize()
        for _ in range(runs):
            began_cpu, began = time.process_time(), time.perf_counter()
            forward(ids, mask)
            cpu += time.process_time() - began_cpu
            torch.cuda.synchronize()
            wall += time.perf_counter() - began
    return cpu / runs * 1e3, wall / runs * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=int, default=2, help="the one core to run on")
    parser.add_argument("--shapes", default=SHAPES, help="ROWSxLENGTH, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.text_launch measures launches on a CUDA device; none is here")
    from transformers import BertConfig, BertModel

    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = BertModel(BertConfig(), add_pooling_layer=False).cuda().half().eval()

    def eager(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(input_ids=ids, attention_mask=mask).last_hidden_state
        return out

    compiled: Forward = torch.compile(eager, dynamic=True)
    began = time.perf_counter()
    timed(compiled, 8, 32, runs=1)
    print(f"compiled in {time.perf_counter() - began:.1f} s", flush=True)
    for shape in args.shapes.split(","):
        rows, length = (int(n) for n in shape.split("x"))
        e_cpu, e_wall = timed(eager, rows, length)
        c_cpu, c_wall = timed(compiled, rows, length)
        print(
            f"{rows} x {length}: eager {e_cpu:.2f} ms CPU, {e_wall:.2f} ms wall; "
            f"compiled {c_cpu:.2f} ms CPU, {c_wall:.2f} ms wall",
            flush=True,
        )


if __name__ == "__main__":
    main()
