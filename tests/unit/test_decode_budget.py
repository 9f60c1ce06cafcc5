"""DecodeBudget: the memory of decodes running at once stays under the budget, and what
each decode holds of it is what it really adds to the process."""

from __future__ import annotations

import functools
import io
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from schemas import ContentType
from workers.decode.budget import DecodeBudget
from workers.decode.images import ImageSpec, decode_image

ROOT = Path(__file__).resolve().parents[2]


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


# What one decode holds of the budget is what it really adds to the process: measured
# as the rise of the peak RSS over one decode (Linux's peak, reset just before it), in a
# process of its own, of an image written by yet another process.
_WRITE = """
import sys
from PIL import Image
mode, side, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
colour = 12 if mode == "L" else (12, 34, 56, 255)[: len(mode)]
Image.new(mode, (side, side), colour).save(path, format="JPEG" if mode == "RGB" else "PNG")
"""
_DECODE = """
import io, json, sys
from pathlib import Path
from PIL import Image
from schemas import DEFAULT_LIMITS, ContentType
from workers.decode.images import ImageSpec, decode_full, decode_image, peak_bytes
path, jpeg, full = Path(sys.argv[1]), sys.argv[2] == "RGB", sys.argv[3] == "full"
payload = path.read_bytes()
kind = ContentType.JPEG if jpeg else ContentType.PNG
counted = peak_bytes(Image.open(io.BytesIO(payload)), "RGB", full=full)
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from now
before = status("VmRSS:")
if full:
    decode_full(payload, kind, "RGB", max_pixels=DEFAULT_LIMITS.max_pixels)
else:
    decode_image(payload, kind, ImageSpec(224, 224, "RGB"), max_pixels=DEFAULT_LIMITS.max_pixels)
print(json.dumps([counted, status("VmHWM:") - before]))
"""
_FIXED_BYTES = 4 << 20  # a decoder's own buffers, whatever the image's size


@pytest.mark.parametrize(
    ("mode", "fit"),
    [("RGBA", "full"), ("RGB", "full"), ("L", "full"), ("RGBA", "fitted"), ("L", "fitted")],
)
def test_a_decode_holds_of_the_budget_every_copy_it_makes(
    mode: str, fit: str, tmp_path: Path
) -> None:
    path = tmp_path / "image"
    run = functools.partial(subprocess.run, check=True, capture_output=True, text=True)
    run([sys.executable, "-c", _WRITE, mode, "3000", str(path)])
    done = run([sys.executable, "-c", _DECODE, str(path), mode, fit], cwd=ROOT)
    counted, risen = json.loads(done.stdout)
    assert risen <= counted + _FIXED_BYTES  # every copy counted: decoded, converted, packed
    assert counted <= 1.25 * risen  # and not much more, or the budget would idle
