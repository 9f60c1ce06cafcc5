"""How the worker's threads wait for its GPU: the device's CUDA scheduling flag.

A GPU worker waits for the device on threads of its own: the finish thread for each
batch's outputs, the prepare thread for nvJPEG's stream. By default (``auto``) CUDA
spins a waiting thread on its core whenever the process has fewer CUDA contexts than
the machine has cores, which is always the case here; with several workers on one
card each spinning thread holds a core for the whole of a batch, and the event loops
that fetch, batch and publish wait for a core behind them. ``block`` makes every wait
sleep on the operating system until the device signals (tens of microseconds to wake,
against batches of milliseconds). The flag is the device's, for the whole process:
stream and device waits (torch's own and the decoders') follow it. An event is waited
for by its own flag, not the device's: the worker makes the events it waits on with
``event``, which follows the mode set here.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Literal

import torch

log = logging.getLogger(__name__)

CudaSync = Literal["auto", "spin", "yield", "block"]

SCHEDULE_FLAGS: dict[str, int] = {"auto": 0x00, "spin": 0x01, "yield": 0x02, "block": 0x04}
"""``cudaDeviceSchedule*`` by setting (``cudaDeviceScheduleBlockingSync`` is 0x04)."""
_SCHEDULE_MASK = 0x07
_blocking = False  # whether ``event`` makes events that block: the mode set last


def set_cuda_sync(device: torch.device, mode: CudaSync) -> None:
    """Make ``device``'s waits ``mode`` for this process, and check that they are.

    Where that cannot be done (a torch without CUDA's runtime, such as a ROCm build, or a
    runtime that refuses), a warning says so and the waits stay as they were: a worker
    serves either way."""
    global _blocking
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    wanted = SCHEDULE_FLAGS[mode]
    try:
        cudart = _cudart()
        status = cudart.cudaSetDeviceFlags(ctypes.c_uint(wanted))
        flags = ctypes.c_uint(0)
        if status == 0:
            status = cudart.cudaGetDeviceFlags(ctypes.byref(flags))
    except (OSError, RuntimeError) as exc:
        log.warning("cuda_sync=%s not applied (%s); waits stay as CUDA chooses", mode, exc)
        return
    if status != 0 or flags.value & _SCHEDULE_MASK != wanted:
        log.warning(
            "cuda_sync=%s not applied: %s waits with flags %#x after asking for %#x (CUDA "
            "error %d); waits stay as CUDA chooses",
            mode, device, flags.value, wanted, status,
        )  # fmt: skip
        return
    _blocking = mode == "block"
    log.info("%s: threads waiting for the device %s (cuda_sync=%s)", device, _HOW[mode], mode)


def event(*, timing: bool = False) -> torch.cuda.Event:
    """A CUDA event for the host to wait on: blocking where ``set_cuda_sync`` chose
    ``block`` (a plain event's wait spins whatever the device's flag), with timing
    if ``timing``."""
    return torch.cuda.Event(enable_timing=timing, blocking=_blocking)  # type: ignore[no-untyped-call]


_HOW = {
    "auto": "spin or yield as CUDA decides",
    "spin": "spin",
    "yield": "spin, yielding their core",
    "block": "sleep until it signals",
}


@cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (the one whose device flags torch's work follows)."""
    version = torch.version.cuda
    if version is None:
        raise RuntimeError(f"torch {torch.__version__} has no CUDA runtime")
    return ctypes.CDLL(f"libcudart.so.{version.split('.')[0]}")
