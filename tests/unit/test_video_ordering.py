"""The pure cores of the video pipeline: frame sampling by time, frame ids, the reorder buffer."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producers.errors import InvalidInput
from producers.settings import ClientSettings
from producers.video import (
    Frame,
    FrameResult,
    FrameSampler,
    ReorderBuffer,
    check_stream_id,
    frame_request_id,
    parse_frame_request_id,
)
from producers.video.command import _answered
from producers.video.send import _frame_record
from schemas import ErrorCode, Status, error_result, ok_result


def kept(sampler: FrameSampler, times: list[Fraction]) -> list[int]:
    return [i for i, t in enumerate(times) if sampler.keep(t)]


def test_25_fps_sampled_at_10_keeps_one_frame_per_tenth_of_a_second() -> None:
    times = [Fraction(i, 25) for i in range(500)]  # 20 s

    indices = kept(FrameSampler(Fraction(10)), times)

    assert len(indices) == 200
    assert indices[:8] == [0, 3, 5, 8, 10, 13, 15, 18]  # 0, .12, .2, .32, .4, ... s


def test_sampling_follows_timestamps_not_frame_indices() -> None:
    # A variable frame rate: a burst of frames 10 ms apart, then a slow stretch.
    times = [Fraction(ms, 1000) for ms in (0, 10, 20, 30, 40, 500, 1000, 1010, 1500)]

    indices = kept(FrameSampler(Fraction(4)), times)  # slots of 250 ms

    assert indices == [0, 5, 6, 8]  # 0 ms, 500 ms, 1000 ms, 1500 ms


def test_slots_count_from_the_first_frame() -> None:
    times = [Fraction(7) + Fraction(i, 30) for i in range(60)]  # a stream starting at 7 s

    indices = kept(FrameSampler(Fraction(2)), times)

    assert indices == [0, 15, 30, 45]


def test_a_source_slower_than_the_rate_keeps_every_frame() -> None:
    times = [Fraction(i, 5) for i in range(20)]

    assert kept(FrameSampler(Fraction(30)), times) == list(range(20))


def test_no_rate_keeps_every_frame() -> None:
    times = [Fraction(0), Fraction(0), Fraction(1, 100)]

    assert kept(FrameSampler(None), times) == [0, 1, 2]


def test_a_frame_going_back_in_time_is_dropped() -> None:
    times = [Fraction(0), Fraction(1), Fraction(1, 2)]

    assert kept(FrameSampler(Fraction(10)), times) == [0, 1]


def test_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="fps must be > 0"):
        FrameSampler(Fraction(0))


@given(
    steps=st.lists(st.fractions(min_value=0, max_value=1, max_denominator=1000), max_size=200),
    fps=st.fractions(min_value=Fraction(1, 10), max_value=120, max_denominator=1001),
)
def test_exactly_the_first_frame_of_every_occupied_slot_is_kept(
    steps: list[Fraction], fps: Fraction
) -> None:
    times = [sum(steps[: i + 1], Fraction(0)) for i in range(len(steps))]

    indices = kept(FrameSampler(fps), times)

    slots = [math.floor((t - times[0]) * fps) for t in times]
    first_of_slot = {slot: slots.index(slot) for slot in slots}
    assert indices == sorted(first_of_slot.values())


def test_frame_request_ids_round_trip_even_with_colons_in_the_stream_id() -> None:
    for stream_id in ("cam1", "site:7:cam-2", "a.b_c"):
        request_id = frame_request_id(stream_id, 42)

        assert parse_frame_request_id(request_id) == (stream_id, 42)


@pytest.mark.parametrize("request_id", ["0f3a9c", "cam1:", ":12", "cam1:1x", "cam1:-3", "cam:²"])
def test_ids_not_made_by_frame_request_id_are_not_frames(request_id: str) -> None:
    assert parse_frame_request_id(request_id) is None


def test_stream_ids_leave_room_for_the_longest_seq() -> None:
    settings = ClientSettings()
    check_stream_id("x" * 108, settings)  # 108 + ":" + 19 digits = 128

    with pytest.raises(InvalidInput, match="1–108 characters"):
        check_stream_id("x" * 109, settings)
    with pytest.raises(InvalidInput, match="stream id 'cam 1'"):
        check_stream_id("cam 1", settings)


def test_reorder_buffer_hands_out_items_in_order() -> None:
    buffer: ReorderBuffer[str] = ReorderBuffer()

    assert buffer.add(2, "c")
    assert buffer.add(1, "b")
    assert buffer.pop_ready() == []
    assert buffer.add(0, "a")

    assert buffer.pop_ready() == [(0, "a"), (1, "b"), (2, "c")]
    assert buffer.next_seq == 3
    assert buffer.held == 0


def test_reorder_buffer_ignores_late_items_and_keeps_the_first_duplicate() -> None:
    buffer: ReorderBuffer[str] = ReorderBuffer(start_seq=5)

    assert not buffer.add(4, "before the start")
    assert buffer.add(6, "first")
    assert not buffer.add(6, "second")
    assert buffer.add(5, "five")
    assert buffer.pop_ready() == [(5, "five"), (6, "first")]
    assert not buffer.add(5, "redelivered")
    assert buffer.pop_ready() == []


def test_skip_gap_gives_up_on_the_numbers_before_the_lowest_held_item() -> None:
    buffer: ReorderBuffer[str] = ReorderBuffer()
    buffer.add(0, "a")
    buffer.add(3, "d")
    buffer.add(5, "f")
    buffer.pop_ready()

    assert list(buffer.skip_gap()) == [1, 2]
    assert buffer.pop_ready() == [(3, "d")]
    assert list(buffer.skip_gap()) == [4]
    assert buffer.pop_ready() == [(5, "f")]
    assert list(buffer.skip_gap()) == []  # nothing held: no gap to skip
    assert buffer.next_seq == 6


def test_the_buffer_is_full_at_capacity() -> None:
    buffer: ReorderBuffer[int] = ReorderBuffer(capacity=2)
    buffer.add(1, 1)
    assert not buffer.full
    buffer.add(2, 2)
    assert buffer.full


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ReorderBuffer(capacity=0)


@given(st.permutations(list(range(30))), st.sets(st.integers(0, 29), max_size=5))
def test_any_arrival_order_comes_out_in_order_with_gaps_reported(
    arrival: list[int], lost: set[int]
) -> None:
    buffer: ReorderBuffer[int] = ReorderBuffer()
    out: list[tuple[int, int | None]] = []
    for seq in arrival:
        if seq not in lost:
            buffer.add(seq, seq * 10)
        out.extend(buffer.pop_ready())
    while buffer.held:  # what a reader does once its timeout passes
        out.extend((seq, None) for seq in buffer.skip_gap())
        out.extend(buffer.pop_ready())

    # Lost items after the last one that came are not a gap yet: nothing follows them.
    last_received = max(set(range(30)) - lost)
    assert [seq for seq, _ in out] == list(range(last_received + 1))
    assert all((item is None) == (seq in lost) for seq, item in out)
    assert all(item == seq * 10 for seq, item in out if item is not None)


@pytest.mark.parametrize(("freshest", "header"), [(True, b"true"), (False, b"false"), (None, None)])
def test_freshest_sets_ce_supersede_on_every_frame(
    freshest: bool | None, header: bytes | None
) -> None:
    frame = Frame(seq=3, time_s=0.1, jpeg=b"\xff\xd8jpeg")
    record = _frame_record(ClientSettings(), "cam1", frame, freshest)
    assert dict(record.headers).get("ce_supersede") == header
    assert dict(record.headers)["ce_stream"] == b"cam1"


def test_a_superseded_frame_counts_as_answered_unless_every_frame_was_asked_for() -> None:
    def frame(status: Status, code: ErrorCode | None) -> FrameResult:
        if code is None:
            result = ok_result("cam1:0", [], model="m", model_version="1", worker="w")
        else:
            result = error_result(
                "cam1:0", code, "m", status=status, model="m", model_version="1", worker="w"
            )
        return FrameResult("cam1", 0, result)

    superseded = frame(Status.expired, ErrorCode.superseded)
    assert _answered(superseded, True)
    assert _answered(superseded, None)  # the worker's setting decided
    assert not _answered(superseded, False)
    assert not _answered(frame(Status.expired, ErrorCode.expired), True)
    assert _answered(frame(Status.ok, None), False)
    assert not _answered(FrameResult("cam1", 0, None), True)  # missing
