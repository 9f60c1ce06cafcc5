"""The canary split: which records each group answers, under markers, chunked and resumed."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from schemas.canary import (
    MARKER_KEY,
    canary_marker,
    commit_note,
    is_marker,
    marker_share,
    read_note,
    request_bucket,
)
from tests.fakes import TOPIC, FakeRecord
from workers.intake.canary import Split
from workers.types import Record

TP = (TOPIC, 0)


def request(offset: int, request_id: str, stream: str | None = None) -> FakeRecord:
    headers = [("ce_specversion", b"1.0"), ("ce_id", request_id.encode())]
    if stream is not None:
        headers.append(("ce_stream", stream.encode()))
    key = (stream or request_id).encode()
    return FakeRecord(TOPIC, 0, offset, key=key, value=b"x", headers=headers)


def marker(offset: int, share: float) -> FakeRecord:
    record = canary_marker(share, "tests")
    return FakeRecord(TOPIC, 0, offset, key=record.key, value=record.value, headers=record.headers)


def partition(count: int, markers: dict[int, float]) -> list[FakeRecord]:
    """``count`` records of one partition: requests, and a marker at each offset of
    ``markers`` with its share."""
    return [marker(n, markers[n]) if n in markers else request(n, f"r-{n}") for n in range(count)]


def answered(split: Split, records: Sequence[Record], chunks: Sequence[int]) -> list[int]:
    """The offsets ``split`` keeps when the records come in chunks of the given sizes."""
    kept: list[int] = []
    start = 0
    for size in chunks:
        chunk = records[start : start + size]
        start += size
        if chunk:
            mine, left = split.take(TP, chunk)
            assert len(mine) + left == len(chunk)
            kept += [r.offset for r in mine]
    assert start >= len(records)
    return kept


def expected_canary(records: Sequence[FakeRecord]) -> set[int]:
    """The offsets the canary answers, from the contract's rule read off the records."""
    share, canary = 0, set()
    for record in records:
        if is_marker(record.key, record.headers):
            found = marker_share(record.value)
            share = share if found is None else found
        elif request_bucket(f"r-{record.offset}") < share:
            canary.add(record.offset)
    return canary


def test_without_a_marker_the_primary_answers_everything() -> None:
    records = partition(50, {})
    assert answered(Split("primary"), records, [50]) == list(range(50))
    assert answered(Split("canary"), records, [50]) == []
    assert answered(Split("shadow"), records, [50]) == list(range(50))


def test_each_request_is_answered_by_exactly_one_group_however_it_is_chunked() -> None:
    records = partition(3000, {100: 0.1, 1700: 0.5, 2500: 0.0})
    requests = {r.offset for r in records if r.key != MARKER_KEY}
    rng = random.Random(7)
    for _ in range(5):
        cuts = [rng.randint(1, 400) for _ in range(40)]
        primary = set(answered(Split("primary"), records, cuts))
        canary = set(answered(Split("canary"), records, [rng.randint(1, 400) for _ in range(40)]))
        assert not primary & canary
        assert primary | canary == requests
        assert canary == expected_canary(records)
    shadow = answered(Split("shadow"), records, [3000])
    assert shadow == sorted(requests)  # every request, no marker


def test_the_share_is_the_fraction_of_requests_within_a_hundredth() -> None:
    records = partition(20_001, {0: 0.1})
    canary = answered(Split("canary"), records, [500] * 41)
    assert abs(len(canary) / 20_000 - 0.1) < 0.01


def test_a_worker_resuming_from_a_commit_decides_as_one_that_read_from_the_start() -> None:
    records = partition(2000, {300: 0.25, 900: 0.75})
    for role in ("primary", "canary"):
        reader = Split(role)
        whole = answered(reader, records, [100] * 20)
        for position in (0, 300, 301, 650, 900, 901, 1500):
            first = Split(role)
            before = answered(first, records[:position], [position or 1])
            note = first.note(TP, position)
            second = Split(role)
            second.resume(TP, position, note)
            after = answered(second, records[position:], [97] * 21)
            assert before + after == whole, (role, position)


def test_a_redelivered_record_gets_the_same_decision_again() -> None:
    records = partition(1000, {10: 0.5})
    split = Split("canary")
    first = answered(split, records, [1000])
    note = split.note(TP, 600)
    again = Split("canary")
    again.resume(TP, 600, note)  # a restart after the commit at 600: 600-999 come again
    assert answered(again, records[600:], [400]) == [o for o in first if o >= 600]


def test_a_stream_goes_to_one_side() -> None:
    records = [marker(0, 0.5)] + [
        request(n, f"frame-{n}", stream="camera-3") for n in range(1, 200)
    ]
    canary = answered(Split("canary"), records, [200])
    assert canary in ([], list(range(1, 200)))
    side = request_bucket("ignored", stream="camera-3") < 5000
    assert bool(canary) is side


def test_records_without_an_id_are_the_primary_groups() -> None:
    bare = FakeRecord(TOPIC, 0, 1, key=None, value=b"?", headers=[("content-type", b"x")])
    records = [marker(0, 0.999), bare]
    assert answered(Split("primary"), records, [2]) == [1]
    assert answered(Split("canary"), records, [2]) == []


def test_a_full_share_leaves_the_primary_nothing() -> None:
    records = partition(100, {0: 1.0})
    assert answered(Split("primary"), records, [100]) == []
    assert answered(Split("canary"), records, [100]) == list(range(1, 100))


def test_an_unreadable_marker_keeps_the_share() -> None:
    broken = FakeRecord(TOPIC, 0, 50, key=MARKER_KEY, value=b"{", headers=marker(0, 0).headers)
    records = [*partition(50, {0: 0.5}), broken, *[request(n, f"r-{n}") for n in range(51, 100)]]
    canary = answered(Split("canary"), records, [100])
    assert canary == sorted(expected_canary(records))
    assert len(canary) > 30  # half of 98 requests: the share stayed


def test_a_key_like_the_markers_without_its_type_is_a_request() -> None:
    impostor = FakeRecord(TOPIC, 0, 0, key=MARKER_KEY, value=b"x", headers=[("ce_id", b"r-0")])
    assert not is_marker(impostor.key, impostor.headers)
    assert answered(Split("primary"), [impostor], [1]) == [0]


def test_marker_and_note_round_trip() -> None:
    record = canary_marker(0.125, "ops")
    assert is_marker(record.key, record.headers)
    assert marker_share(record.value) == 1250
    assert read_note(commit_note(1250)) == 1250
    assert read_note(None) == 0
    assert read_note("written by another tool") == 0
    with pytest.raises(ValueError, match="from 0 to 1"):
        canary_marker(1.5, "ops")


def test_the_bucket_is_the_contracts_hash() -> None:
    # docs/contract.md gives these, for other languages to check their implementation.
    assert request_bucket("req-1") == 3243
    assert request_bucket("req-2") == 8997
    assert request_bucket("req-1", stream="camera-7") == 9478
