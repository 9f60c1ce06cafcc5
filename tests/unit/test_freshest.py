"""Freshest-frame bookkeeping: the newest waiting frame of a stream supersedes the older ones."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.batching.freshest import LatestFrames


class Frame:
    """A frame of ``stream`` (None: outside freshest-frame mode), told apart by identity."""

    def __init__(self, stream: str | None, seq: int) -> None:
        self.stream = stream
        self.seq = seq

    def __repr__(self) -> str:
        return f"Frame({self.stream}, {self.seq})"


def frames_of(stream: str | None, count: int) -> list[Frame]:
    return [Frame(stream, n) for n in range(count)]


def make() -> LatestFrames[Frame]:
    return LatestFrames(lambda frame: frame.stream)


def test_a_newer_frame_supersedes_the_waiting_ones_of_its_stream_only() -> None:
    latest = make()
    a, b = frames_of("a", 3), frames_of("b", 1)
    latest.arrived([a[0], b[0], a[1], a[2]])
    assert [latest.is_superseded(f) for f in a] == [True, True, False]
    assert not latest.is_superseded(b[0])
    assert latest.superseded == 2
    assert len(latest) == 4


def test_frames_that_leave_stop_counting() -> None:
    latest = make()
    a = frames_of("a", 3)
    latest.arrived(a)
    latest.left(a[:2])  # the superseded ones, answered
    assert latest.superseded == 0
    latest.left(a[2:])
    assert len(latest) == 0
    latest.arrived([Frame("a", 3)])  # a forgotten stream starts afresh
    assert latest.superseded == 0


def test_a_frame_arriving_after_the_newest_left_supersedes_only_frames_still_waiting() -> None:
    latest = make()
    f0, f1, f2 = frames_of("a", 3)
    latest.arrived([f0, f1])
    assert latest.superseded == 1  # f0
    latest.left([f1])  # went to the model first (another lane)
    latest.arrived([f2])
    assert latest.superseded == 1  # still f0 only: f1 is no longer waiting
    assert latest.is_superseded(f0)
    assert not latest.is_superseded(f2)


def test_requests_outside_the_mode_are_ignored() -> None:
    latest = make()
    plain = frames_of(None, 3)
    latest.arrived(plain)
    latest.left(plain)
    assert latest.superseded == 0
    assert not any(latest.is_superseded(f) for f in plain)
    assert len(latest) == 0


@given(
    events=st.lists(
        st.tuples(st.sampled_from(["arrive", "leave"]), st.sampled_from(["a", "b", "c"])),
        max_size=60,
    )
)
def test_the_count_matches_the_frames_superseded(events: list[tuple[str, str]]) -> None:
    latest = make()
    waiting: list[Frame] = []
    newest: dict[str | None, Frame] = {}
    for n, (event, stream) in enumerate(events):
        if event == "arrive":
            frame = Frame(stream, n)
            latest.arrived([frame])
            waiting.append(frame)
            newest[stream] = frame
        else:
            # The oldest waiting frame of the stream leaves (as batches take them).
            mine = [f for f in waiting if f.stream == stream]
            if mine:
                latest.left([mine[0]])
                waiting.remove(mine[0])
        superseded = [f for f in waiting if newest[f.stream] is not f]
        assert latest.superseded == len(superseded)
        assert [f for f in waiting if latest.is_superseded(f)] == superseded
        assert len(latest) == len(waiting)
