"""What a run shows: the summary rows, the table printed last and the plot.

One row per corpus and layout against its ceilings and the naive baseline
(``summarize``), the table, the plot, and the rounding of the rows the stages print as
they go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.plot import Line, Panel, draw_panels


def _model_ceiling(forward: dict[str, Any], row: dict[str, Any]) -> float:
    """Forward at the largest batch timed, compiled where the layout's workers were."""
    variant = "compiled" if row.get("compiled") and "compiled" in forward else "eager"
    by_size = forward.get(variant, {})
    largest = max(by_size, key=int, default=None)
    return float(by_size[largest]["img_s"]) if largest is not None else math.nan


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per corpus: the worker (one process, one GPU) against its ceilings and the
    naive baseline; then one row per other layout measured (several workers, GPUs)."""
    rows = []
    forward = results.get("forward", {})
    e2e = results.get("e2e", {})
    for name in ("640x480", "224x224"):
        naive = results.get("naive", {}).get(name, {})
        decode = results.get("decode", {}).get(name, {})
        pipeline = results.get("pipeline", {}).get(f"gpu-decode {name}", {})
        for layout, row in sorted((k.split()[0], v) for k, v in e2e.items() if k.endswith(name)):
            ceiling = min(_model_ceiling(forward, row), decode.get("best", math.nan))
            worker = row.get("img_s", math.nan)
            one = e2e.get(f"{layout.partition('x')[0]}x1 {name}", {})  # the same, on one card
            kept_up = row.get("paced_kept_up", True)
            rows.append(
                {
                    "images": name,
                    "layout": layout,
                    "naive_img_s": naive.get("img_s", math.nan),
                    "pipeline_img_s": pipeline.get("img_s", math.nan),
                    "e2e_img_s": worker,
                    "e2e_min": row.get("img_s_min", math.nan),
                    "e2e_max": row.get("img_s_max", math.nan),
                    "p50_ms": row.get("p50_ms", math.nan) if kept_up else math.nan,
                    "p99_ms": row.get("p99_ms", math.nan) if kept_up else math.nan,
                    "bound_ms": row.get("latency_bound_ms", math.nan),
                    "profile": row.get("profile", "-"),
                    "gpu_util_pct": row.get("gpu_util_pct", math.nan),
                    "ceiling_img_s": ceiling * row.get("gpus", 1),
                    "vs_naive": worker / naive.get("img_s", math.nan),
                    "vs_ceiling": worker / (ceiling * row.get("gpus", 1)),
                    "vs_one": worker / one.get("img_s", math.nan),
                }
            )
        ceiling = min(_model_ceiling(forward, {}), decode.get("best", math.nan))  # eager
        measured = (naive.get("img_s", math.nan), pipeline.get("img_s", math.nan), ceiling)
        if not any(r["images"] == name for r in rows) and not all(map(math.isnan, measured)):
            rows.append(
                {
                    "images": name,
                    "layout": "-",
                    "naive_img_s": naive.get("img_s", math.nan),
                    "pipeline_img_s": pipeline.get("img_s", math.nan),
                    "e2e_img_s": math.nan,
                    "e2e_min": math.nan,
                    "e2e_max": math.nan,
                    "p50_ms": math.nan,
                    "p99_ms": math.nan,
                    "bound_ms": math.nan,
                    "profile": "-",
                    "gpu_util_pct": math.nan,
                    "ceiling_img_s": ceiling,
                    "vs_naive": math.nan,
                    "vs_ceiling": math.nan,
                    "vs_one": math.nan,
                }
            )
    return rows


def print_table(rows: Sequence[dict[str, Any]], card: str, model: str) -> None:
    if not rows:  # only stages without a classification row ran (detect, kill)
        return
    print(f"\nConveyor GPU benchmark on {card} ({model}, random weights)")
    header = (
        f"{'images':>8} {'layout':>7} {'profile':>10} {'naive/s':>8} {'worker/s':>9} "
        f"{'(min-max)':>13} {'p50 ms':>7} {'p99 ms':>7} {'bound':>6} {'GPU %':>6} "
        f"{'ceiling/s':>10} {'×naive':>7} {'×ceil':>6} {'×1card':>6}"
    )
    print(header)
    for r in rows:
        spread = f"{r['e2e_min']:,.0f}-{r['e2e_max']:,.0f}"
        print(
            f"{r['images']:>8} {r['layout']:>7} {r['profile']:>10} {r['naive_img_s']:>8,.0f} "
            f"{r['e2e_img_s']:>9,.0f} {spread:>13} "
            f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['bound_ms']:>6.1f} "
            f"{r['gpu_util_pct']:>6.0f} {r['ceiling_img_s']:>10,.0f} {r['vs_naive']:>7.1f} "
            f"{r['vs_ceiling']:>6.2f} {r['vs_one']:>6.2f}"
        )
    print(
        "layout: processes a card x cards of one `conveyor worker`; worker/s: median of the "
        "repeats' steady state; goals: one card ≥ 0.9× ceiling (min of the forward at the "
        "batch size and the best decode+resize) and ≥ 30× naive, 2 cards ≥ 1.9× one, 4 ≥ "
        "3.6×; p99 at half the peak ≤ bound (5 ms + 2 × p99 batch compute), nan where the "
        "paced producers fell behind their rate"
    )


def plot(results: dict[str, Any], rows: Sequence[dict[str, Any]], path: Path, card: str) -> None:
    panels = []
    names = [f"{r['images']} {r['layout']}" for r in rows]
    panels.append(
        Panel(
            title="Throughput by path",
            unit="img/s",
            groups=names,
            series=["naive", "pipeline", "worker e2e", "ceiling"],
            values=[
                _bars([r["naive_img_s"], r["pipeline_img_s"], r["e2e_img_s"], r["ceiling_img_s"]])
                for r in rows
            ],
            note="0 = not measured in this run",
        )
    )
    decode = results.get("decode", {})
    if decode:
        keys = ["pillow_1_draft", "pillow_threads_draft", "nvjpeg_decode", "nvjpeg_decode_resize"]
        panels.append(
            Panel(
                title="Decode + resize to 224",
                unit="img/s",
                groups=list(decode),
                series=["Pillow 1", "Pillow N threads", "nvJPEG", "nvJPEG+resize"],
                values=[_bars([decode[g].get(k, math.nan) for k in keys]) for g in decode],
            )
        )
    forward = results.get("forward", {})
    variants = [v for v in ("eager", "compiled") if v in forward]
    if variants:
        sizes = list(forward[variants[0]])
        model = results.get("meta", {}).get("model")
        panels.append(
            Panel(
                title=f"{model} forward ({forward.get('precision')})",
                unit="img/s",
                groups=[f"batch {s}" for s in sizes],
                series=variants,
                values=[
                    _bars([forward[v].get(s, {}).get("img_s", math.nan) for v in variants])
                    for s in sizes
                ],
                lines=[Line(max((r["naive_img_s"] for r in rows), default=math.nan), "naive")],
            )
        )
    draw_panels(panels, path, title=f"Conveyor on {card}")


def _bars(values: Sequence[float]) -> list[float]:
    """Missing measurements drawn as 0 (the table and the JSON say n/a / NaN)."""
    return [v if math.isfinite(v) else 0.0 for v in values]


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4) if abs(value) < 10 else round(value, 1)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value
