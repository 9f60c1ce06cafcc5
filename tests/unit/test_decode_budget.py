"""DecodeBudget: the memory of decodes running at once stays under the budget."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from schemas import ContentType
from workers.decode.budget import DecodeBudget
from workers.decode.images import ImageSpec, decode_image


def test_holders_never_exceed_the_limit_and_oversized_ones_run_alone() -> None:
    budget = DecodeBudget(100)
    lock = threading.Lock()
    peak = {"bytes": 0, "alone_violations": 0}
    running: list[int] = []

    def work(nbytes: int) -> None:
        with budget.hold(nbytes):
            with lock:
                running.append(nbytes)
                peak["bytes"] = max(peak["bytes"], sum(min(n, 100) for n in running))
                if nbytes > 100 and len(running) > 1:
                    peak["alone_violations"] += 1
            time.sleep(0.002)
            with lock:
                running.remove(nbytes)

    sizes = [30, 70, 45, 500, 10, 99, 60, 100, 25, 250] * 5
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, sizes))
    assert peak["bytes"] <= 100
    assert peak["alone_violations"] == 0
    assert budget.used == 0


def test_a_failing_decode_gives_its_room_back() -> None:
    budget = DecodeBudget(1 << 20)
    spec = ImageSpec(height=8, width=8, mode="L")
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (64, 64, 4), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(buffer, format="PNG")
    png = buffer.getvalue()
    with pytest.raises(ValueError, match="not a valid PNG image"):
        # The header reads fine; the pixels fail while the budget is held.
        decode_image(png[: len(png) // 2], ContentType.PNG, spec, max_pixels=10**6, budget=budget)
    assert budget.used == 0
    tensor = decode_image(png, ContentType.PNG, spec, max_pixels=10**6, budget=budget)
    assert tuple(tensor.shape) == (1, 8, 8)
    assert budget.used == 0


def test_an_empty_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 byte"):
        DecodeBudget(0)
