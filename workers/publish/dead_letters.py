"""Dead letters: a refused record's copy on the dead-letter topic, cut to fit it.

A copy keeps the original's key, value and headers, with the reason in headers of
its own (``schemas.dlq``). A value larger than the topic accepts is cut, its original
size and SHA-256 in headers; a topic that refuses even that gets the headers alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
)

from schemas.dlq import truncated
from workers.publish.errors import WriteRefused
from workers.types import DeadLetter

log = logging.getLogger(__name__)

RECORD_OVERHEAD = 512
"""Record and batch framing beside a record's key, value and headers, in bytes."""
TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)
"""What the broker answers to a record or batch above a topic's limit."""


class DeadLetters:
    """Sends dead letters to one topic of a known size limit."""

    def __init__(self, topic: str, limit: int) -> None:
        self.topic = topic
        self.limit = limit  # the topic's max.message.bytes

    async def send(self, producer: AIOKafkaProducer, letters: list[DeadLetter]) -> None:
        """Send every letter, cut to fit the topic; acknowledged ones leave the list.

        Raises ``WriteRefused`` naming the topic when the broker refuses this worker's
        writes there (its error names no topic)."""
        while letters:
            letter = self._fit(letters[0])
            try:
                await send_one(producer, self.topic, None, letter.key, letter.value, letter.headers)
            except TOO_LARGE:
                # The topic's limit is lower than it said at start-up: keep headers only.
                log.error("dead-letter topic refused a copy as too large; sending it empty")
                value, cut = truncated(letter.value or b"", 0)
                headers = [*letter.headers, *cut]
                await send_one(producer, self.topic, None, letter.key, value, headers)
            except TopicAuthorizationFailedError as exc:
                raise WriteRefused(self.topic) from exc
            letters.pop(0)

    def _fit(self, letter: DeadLetter) -> DeadLetter:
        """The letter, its value cut to what the dead-letter topic accepts if need be."""
        value = letter.value
        if value is None:
            return letter
        others = sum(len(n) + len(v or b"") for n, v in letter.headers) + len(letter.key or b"")
        room = self.limit - RECORD_OVERHEAD - others - 256  # 256: the two size headers
        if len(value) <= room:
            return letter
        cut, headers = truncated(value, room)
        log.warning(
            "dead-letter copy of %d bytes cut to %d to fit topic %s",
            len(value),
            len(cut),
            self.topic,
        )
        return DeadLetter(letter.key, cut, [*letter.headers, *headers])


async def send_one(
    producer: AIOKafkaProducer,
    topic: str,
    partition: int | None,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes | None]],
) -> None:
    """Send one record and wait for the broker's acknowledgement."""
    future = await producer.send(topic, value, key=key, partition=partition, headers=list(headers))
    await future
