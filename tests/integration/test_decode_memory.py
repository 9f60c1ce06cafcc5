"""The decode budget bounds what decoding adds to a worker's memory: a worker with 8 decode
threads and a small budget, sent a few hundred images at once, each of its pixel limit and
costly to decode, answers them all while its peak RSS rises by less than the budget.
Real worker process, real broker, real Redis."""

from __future__ import annotations

import time
from io import BytesIO
from pathlib import Path

import pytest
from PIL import Image

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, requests, wait_for_results
from schemas import ContentType, Status, topics_for
from tests.harness import digit_requests

SIDE = 4300
"""Each image is SIDE x SIDE grey pixels, the worker's pixel limit (18.5 MP, the contract's
40 MP scaled down). Not smaller: the image and its copy must each stay above the 17 MiB
from which the worker's allocations are mapped and given back when freed
(``workers.kafka.fetch_buffers``); below it each decode thread's heap keeps its largest
copies, on top of the budget (docs/reliability.md, Memory)."""
IMAGES = 200
PARTITIONS = 8  # a chunk of records a partition, so that the 8 decode threads all have work
BUDGET_MB = 128
# The digits model fits an image to 8x8 grey: the budget counts 3 bytes a pixel for a grey
# PNG (the decoded pixels, their copy, resampling's), 55 MB an image, 37 MB of it real; the
# 200 images are 11 GB counted. The budget lets 2 decode at once; without it the 8 threads
# decode 8 at once, and the peak RSS rose by 254 MB (a 2-core VM), twice the budget.


def _flat_grey_png(side: int) -> bytes:
    """A grey PNG of side x side pixels of one value: 18.5 MB decoded, 28 KB sent."""
    buffer = BytesIO()
    Image.new("L", (side, side), 12).save(buffer, format="PNG")
    return buffer.getvalue()


def _reset_peak_rss(pid: int) -> float:
    """Start the process's peak RSS (VmHWM) again from its RSS now; that RSS, in MiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_mb(pid, "VmRSS")


def _status_mb(pid: int, field: str) -> float:
    """A memory field (VmRSS, VmHWM) of /proc/PID/status, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_decode_budget_bounds_the_rise_of_peak_rss(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=PARTITIONS)
    worker = workers.start(
        *("--decode-threads", "8", "--decode-memory-mb", str(BUDGET_MB)),
        env={"CONVEYOR_LIMITS__MAX_PIXELS": str(SIDE * SIDE)},
    )
    # Warm: the model has run and every stage has started before the baseline is taken.
    warm, warm_ids = digit_requests(digits, 64, prefix=f"{model_name}-warm")
    await produce(kafka_bootstrap, topics.requests, warm, round_robin=True)
    assert len(await wait_for_results(redis_url, warm_ids, timeout_s=60)) == 64, worker.log()

    baseline_mb = _reset_peak_rss(worker.pid)
    large, ids = requests([_flat_grey_png(SIDE)], IMAGES, model_name, ContentType.PNG)
    started = time.monotonic()
    await produce(kafka_bootstrap, topics.requests, large, round_robin=True)
    results = await wait_for_results(redis_url, ids, timeout_s=90)
    took_s = time.monotonic() - started
    rise_mb = _status_mb(worker.pid, "VmHWM") - baseline_mb

    assert len(results) == IMAGES, worker.log()
    assert {r.status for r in results.values()} == {Status.ok}
    seen = f"{IMAGES} images in {took_s:.1f} s: the peak RSS rose {rise_mb:.0f} MB"
    assert rise_mb < BUDGET_MB, f"{seen}, over the {BUDGET_MB} MB budget"
