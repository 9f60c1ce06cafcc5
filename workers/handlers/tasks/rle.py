"""Binary masks to COCO run-length encoding, vectorised with NumPy.

The output is what ``pycocotools.mask.encode`` writes (``schemas.Rle``): run lengths
of the mask in column-major order, starting with a run of 0s, in COCO's compressed
string form. ``schemas.outputs.decode_rle_counts`` reads it back.

Masks of detected objects are mostly empty: ``encode_columns`` takes just the band
of columns an object touches (full height, one row per column: already in the
encoding's order) and accounts for the empty columns on either side arithmetically,
so a worker copies and scans only that band.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_BASE = 48
_GROUPS = 7  # 5-bit groups in the longest number: a difference of two uint32 counts


def run_lengths(flat: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """Alternating run lengths (0s first) of a 1-D boolean array."""
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    edges = np.concatenate(([0], changes, [flat.size]))
    runs = np.diff(edges)
    if flat.size and flat[0]:
        runs = np.concatenate(([0], runs))  # the first run counts 0s, here none
    return runs.astype(np.int64)


def encode_columns(columns: npt.NDArray[np.bool_], left: int, width: int) -> str:
    """The RLE string of a mask ``width`` wide that is empty outside columns ``left`` to
    ``left + len(columns)``, given those columns: ``columns[k]`` is column ``left + k``
    from top to bottom (the transpose of that part of the mask)."""
    count, height = columns.shape
    if left < 0 or left + count > width:
        raise ValueError(f"columns {left}..{left + count} are outside a mask {width} wide")
    runs = run_lengths(np.ascontiguousarray(columns).reshape(-1))
    before, after = left * height, (width - left - count) * height
    if runs.size == 1:
        # All 0s (or no columns at all): one run of 0s over the whole mask.
        return compress_counts(np.array([width * height], dtype=np.int64))
    runs = runs.copy()
    runs[0] += before
    if runs.size % 2:  # ends with 0s
        runs[-1] += after
    elif after:
        runs = np.concatenate((runs, [after]))
    return compress_counts(runs)


def encode_mask(mask: npt.NDArray[np.bool_]) -> str:
    """The RLE string of a whole ``(height, width)`` boolean mask."""
    return encode_columns(mask.T, 0, mask.shape[1])


def compress_counts(counts: npt.NDArray[np.int64]) -> str:
    """COCO's compressed string for run lengths, every count at once.

    The same bytes as ``schemas.outputs.encode_rle_counts``: counts from the fourth on
    are differences from the count two before; each number is written 5 bits at a
    time (low first), a character ``48 + group`` with bit 5 set while more follow.
    """
    values = counts.astype(np.int64)
    if values.size > 3:
        values[3:] -= counts[1:-2]
    groups = np.zeros((values.size, _GROUPS), dtype=np.uint8)
    used = np.zeros(values.size, dtype=np.int64)
    active = np.ones(values.size, dtype=bool)
    for k in range(_GROUPS):
        low = values & 0x1F
        values >>= 5  # arithmetic: a negative difference ends in -1
        more = np.where(low & 0x10, values != -1, values != 0)
        groups[:, k] = low + _BASE + 0x20 * more
        used += active
        active &= more
        if not active.any():
            break
    keep = np.arange(_GROUPS) < used[:, None]
    return groups[keep].tobytes().decode("ascii")
