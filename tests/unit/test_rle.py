"""COCO RLE of masks (workers.handlers.tasks.rle) against pycocotools, the reference implementation.

pycocotools is what readers of Conveyor's masks most likely use (and what Detectron2
and the COCO evaluation use); byte-for-byte equal strings mean they read our masks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pycocotools.mask as coco
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from schemas.outputs import Rle, decode_rle_counts, encode_rle_counts
from workers.handlers.tasks.rle import compress_counts, encode_columns, encode_mask, run_lengths

masks = st.tuples(st.integers(1, 40), st.integers(1, 40)).flatmap(
    lambda shape: arrays(np.bool_, shape)
)


def reference(mask: npt.NDArray[np.bool_]) -> str:
    encoded = coco.encode(np.asfortranarray(mask.astype(np.uint8)))
    counts: bytes = encoded["counts"]
    return counts.decode("ascii")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks)
def test_masks_encode_as_pycocotools_does(mask: npt.NDArray[np.bool_]) -> None:
    text = encode_mask(mask)

    assert text == reference(mask)
    assert Rle(size=mask.shape, counts=text).to_bytes() == mask.astype(np.uint8).tobytes()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_vectorised_and_pure_python_compression_agree(counts: list[int]) -> None:
    text = compress_counts(np.array(counts, dtype=np.int64))

    assert text == encode_rle_counts(counts)
    assert decode_rle_counts(text) == counts


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks, st.data())
def test_a_band_of_columns_encodes_like_the_whole_mask(
    mask: npt.NDArray[np.bool_], data: st.DataObject
) -> None:
    width = mask.shape[1]
    left = data.draw(st.integers(0, width))
    right = data.draw(st.integers(left, width))
    mask[:, :left] = False
    mask[:, right:] = False  # empty outside the band, as a detected object's mask is

    assert encode_columns(mask[:, left:right].T, left, width) == reference(mask)


def test_runs_start_with_zeros() -> None:
    assert run_lengths(np.array([True, True, False])).tolist() == [0, 2, 1]
    assert run_lengths(np.array([False, False])).tolist() == [2]
    assert run_lengths(np.array([], dtype=bool)).tolist() == [0]
