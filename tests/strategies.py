"""Hypothesis strategies for the wire contract's values: ids, topics, texts, JSON, times,
trace contexts, record headers near the valid ones, and result timings.

The property tests of the full decoders (tests/unit/test_schemas_properties.py) and of
the hot-path codecs (tests/unit/test_fastpath.py) draw from the same ones.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import strategies as st

from schemas import Header, Timings

ids = st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)
texts = st.text(st.characters(codec="utf-8"), max_size=40)
topics = st.from_regex(r"[A-Za-z0-9._-]{1,249}", fullmatch=True).filter(
    lambda name: name not in (".", "..")
)
traceparents = st.from_regex(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", fullmatch=True).filter(
    lambda value: "-" + "0" * 32 + "-" not in value and "-" + "0" * 16 + "-" not in value
)
offsets = st.integers(min_value=-23 * 3600, max_value=23 * 3600).map(
    lambda seconds: timezone(timedelta(seconds=seconds))
)
aware_datetimes = st.datetimes(
    min_value=datetime(1000, 1, 2), max_value=datetime(9999, 12, 30), timezones=offsets
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)


def json_values(depth: int) -> st.SearchStrategy[Any]:
    if depth == 0:
        return scalars
    inner = json_values(depth - 1)
    return scalars | st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3)


# The top-level object is depth 1, so values may nest 7 more within the default of 8.
params = st.dictionaries(texts, json_values(7), max_size=4)

# Header values that get past the first checks, so the random part reaches deep code.
interesting = st.sampled_from(
    [
        b"1.0",
        b"conveyor.request.v1",
        b"image/png",
        b"image/png; charset=utf-8",
        b"req-1",
        b"2025-01-31T12:00:00Z",
        b"9999-12-31T23:59:59-23:59",
        b"{}",
        b'{"a":[[[[[[[[[]]]]]]]]]}',
        b"18446744073709551616",
        b"true",
        b"false",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"\xff",
        b"",
    ]
)

header_names = st.sampled_from([h.value for h in Header]) | texts
header_values = st.none() | interesting | st.binary(max_size=80)
VALID = [
    ("ce_specversion", b"1.0"),
    ("ce_id", b"req-1"),
    ("ce_type", b"conveyor.request.v1"),
    ("ce_source", b"s"),
    ("content-type", b"image/png"),
]


@st.composite
def record_headers(draw: st.DrawFn) -> list[tuple[str, bytes | None]]:
    """Either headers from nothing, or valid headers with some dropped, changed or added."""
    extra = draw(st.lists(st.tuples(header_names, header_values), max_size=12))
    if draw(st.booleans()):
        return extra
    kept = [header for header in VALID if draw(st.integers(0, 5))]
    return draw(st.permutations(kept + extra))


finite = st.floats(allow_nan=False, allow_infinity=False)
timings = st.builds(
    Timings,
    produced_ms=st.integers(min_value=0, max_value=2**53),
    received_ms=finite,
    batch_start_ms=st.none() | finite,
    finished_ms=finite,
    queue_ms=finite,
    inference_ms=finite,
    batch_size=st.integers(min_value=0, max_value=4096),
)
