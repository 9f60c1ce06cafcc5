"""The host's GPUs, read with ``nvidia-smi``: no CUDA context in the supervisor.

A supervisor that initialised CUDA itself would hold memory on every card for its
whole life, and, started before the MPS server, stand beside it as a client of its
own. ``nvidia-smi`` reads the same facts through NVML. ``CUDA_VISIBLE_DEVICES``
(indices or UUIDs) is applied as CUDA applies it, so index ``k`` here is
``cuda:k`` in the worker processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from workers.fleet.plan import Card

_QUERY = "index,uuid,name,memory.total,memory.used"
_TIMEOUT_S = 30.0


def visible_cards() -> list[Card]:
    """The GPUs this process may use, numbered as CUDA numbers them; empty without any
    (no driver, no ``nvidia-smi``, or ``CUDA_VISIBLE_DEVICES`` empty)."""
    rows = _query()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        order = [part.strip() for part in visible.split(",") if part.strip()]
        chosen = []
        for wanted in order:
            match = [r for r in rows if wanted in (r[0], r[1]) or r[1].startswith(wanted)]
            if not match:
                break  # CUDA stops at the first entry it cannot find
            chosen.append(match[0])
        rows = chosen
    return [
        Card(index, name, int(float(total)), int(float(used)), uuid)
        for index, (_, uuid, name, total, used) in enumerate(rows)
    ]


def memory_used_mb(card: Card) -> int | None:
    """MiB in use on ``card`` now (all processes, an MPS server's included), or None."""
    rows = visible_cards()
    return rows[card.index].used_mb if card.index < len(rows) else None


def _query() -> list[tuple[str, str, str, str, str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run(
            [smi, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in done.stdout.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 5:
            rows.append((parts[0], parts[1], parts[2], parts[3], parts[4]))
    return rows
