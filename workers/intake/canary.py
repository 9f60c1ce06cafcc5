"""The canary split: which fetched records this worker answers, and which it leaves to the
model's other consumer group (the rule is ``schemas.canary``'s).

Every worker applies it, whatever its role: a primary worker answers the requests
outside the canary's share, a canary worker (``--canary``) those inside it, and a
shadow (``--shadow``) all of them. None of them answers a canary marker. Per
partition, ``Split`` keeps the share in effect at each offset: the one at the
position the worker started from (the metadata committed with that position, given
to ``resume``), then each marker's from the offset after it (``take``). A commit of a
position carries the share there (``note``), so whoever reads the partition next
starts with the share the records after it were decided with.

The decision uses the record alone (its ``ce_stream`` or ``ce_id`` header, its
offset), never how this worker's settings parse it, so the two groups always
decide alike. Its cost per record: one comparison of the key with the marker's,
and with a share strictly between 0 and 100% a scan of the headers and a hash. A
share of 0 or 100% decides a whole chunk at once.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

from schemas import Header, Role
from schemas.canary import (
    BUCKETS,
    MARKER_KEY,
    bucket,
    commit_note,
    is_marker,
    marker_share,
    read_note,
)
from workers.types import Record, TopicPartition

__all__ = ["Split"]

log = logging.getLogger(__name__)

_ID, _STREAM = Header.ID.value, Header.STREAM.value  # plain str: compared once per header


class _Shares:
    """One partition's shares: ``points[i]`` is in effect from offset ``starts[i]`` on."""

    __slots__ = ("points", "starts")

    def __init__(self, start: int, points: int) -> None:
        self.starts = [start]
        self.points = [points]

    def at(self, offset: int) -> int:
        i = bisect.bisect_right(self.starts, offset) - 1
        return self.points[max(i, 0)]

    def change(self, start: int, points: int) -> None:
        if start <= self.starts[-1]:  # read again after a seek back: the later entries go
            i = bisect.bisect_left(self.starts, start)
            del self.starts[i:], self.points[i:]
            if not self.starts:
                self.starts, self.points = [start], [points]
                return
        self.starts.append(start)
        self.points.append(points)

    def settled(self, offset: int) -> bool:
        """Whether the share no longer changes from ``offset`` on (as far as read)."""
        return self.starts[-1] <= offset

    def forget_before(self, position: int) -> None:
        """Drop what no record at or after ``position`` needs."""
        i = bisect.bisect_right(self.starts, position) - 1
        if i > 0:
            del self.starts[:i], self.points[:i]


class Split:
    """Decides, per partition and record, whether this worker's group answers it."""

    def __init__(self, role: Role) -> None:
        self._role = role
        self._shares: dict[TopicPartition, _Shares] = {}
        self.latest = 0
        """The share (basis points) of the last marker read, or committed where it last
        resumed."""

    def resume(self, tp: TopicPartition, position: int, note: str | None) -> None:
        """``tp`` is read from ``position`` on, where the share is what ``note`` (the metadata
        committed with that position) records: 0 when it records none."""
        points = read_note(note)
        self._shares[tp] = _Shares(position, points)
        self.latest = points
        if points:
            log.info(
                "%s[%d]: canary share %s at offset %d, as committed",
                *tp,
                _percent(points),
                position,
            )

    def note(self, tp: TopicPartition, position: int) -> str:
        """The metadata to commit with ``position`` of ``tp``: the share in effect there.

        Positions of a partition are committed in increasing order, so what only
        records below ``position`` needed is dropped.
        """
        shares = self._shares.get(tp)
        if shares is None:
            return commit_note(0)
        points = shares.at(position)
        shares.forget_before(position)
        return commit_note(points)

    def take(self, tp: TopicPartition, records: Sequence[Record]) -> tuple[Sequence[Record], int]:
        """Those of a partition's fetched ``records`` (in offset order) that this worker
        answers, and how many it leaves: markers (their shares noted) and requests the
        other group answers."""
        first = records[0].offset
        shares = self._shares.get(tp)
        if shares is None:  # never resumed (no commit read): no canary before its markers
            shares = self._shares[tp] = _Shares(first, 0)
        if shares.settled(first) and not any(record.key == MARKER_KEY for record in records):
            mine = self._decided(records, shares.points[-1])
        else:
            mine = self._one_by_one(tp, records, shares)
        return mine, len(records) - len(mine)

    def _decided(self, records: Sequence[Record], points: int) -> Sequence[Record]:
        """``records`` under one share throughout."""
        if self._role == "shadow":
            return records
        canary = self._role == "canary"
        if points <= 0:
            return [] if canary else records
        if points >= BUCKETS:
            return records if canary else []
        return [record for record in records if _canary_side(record, points) is canary]

    def _one_by_one(
        self, tp: TopicPartition, records: Sequence[Record], shares: _Shares
    ) -> list[Record]:
        """``records`` with markers among them, or a share that changes among them."""
        mine: list[Record] = []
        canary = self._role == "canary"
        for record in records:
            if record.key == MARKER_KEY and is_marker(record.key, record.headers):
                self._marker(tp, record, shares)
                continue
            if self._role == "shadow":
                mine.append(record)
                continue
            points = shares.at(record.offset)
            side = _canary_side(record, points) if 0 < points < BUCKETS else points >= BUCKETS
            if side is canary:
                mine.append(record)
        return mine

    def _marker(self, tp: TopicPartition, record: Record, shares: _Shares) -> None:
        points = marker_share(record.value)
        if points is None:
            log.warning(
                "%s[%d]@%d: a canary marker whose share cannot be read; the share stays %s",
                *tp,
                record.offset,
                _percent(shares.at(record.offset)),
            )
            return
        shares.change(record.offset + 1, points)
        self.latest = points
        log.info(
            "%s[%d]: canary share %s after the marker at %d", *tp, _percent(points), record.offset
        )


def _canary_side(record: Record, points: int) -> bool:
    """Whether a request falls in the canary's share; a record with neither a stream nor an
    id is the primary group's (it answers what cannot be parsed)."""
    request_id = stream = None
    for name, raw in record.headers:
        if name == _STREAM:
            stream = raw
        elif name == _ID:
            request_id = raw
    key = stream if stream is not None else request_id
    return key is not None and bucket(key) < points


def _percent(points: int) -> str:
    return f"{points * 100 / BUCKETS:g}%"
