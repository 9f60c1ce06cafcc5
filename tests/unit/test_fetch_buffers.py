"""FrameReader: length-prefixed frames out of chunks as a transport delivers them."""

from __future__ import annotations

import asyncio
import struct

import aiokafka.conn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import _imaging

from tests.fakes import FakeTransport
from workers.kafka.fetch_buffers import (
    IMAGE_BLOCK_BYTES,
    MAX_FETCH_BYTES,
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
    FrameReader,
    install,
    keep_large_buffers,
    set_allocator,
)

LIMIT = 64


def reader() -> tuple[FrameReader, FakeTransport]:
    transport = FakeTransport()
    frames = FrameReader(LIMIT, asyncio.get_running_loop())
    frames.set_transport(transport)
    return frames, transport


def framed(payloads: list[bytes]) -> bytes:
    return b"".join(struct.pack(">i", len(p)) + p for p in payloads)


async def read_frames(frames: FrameReader, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        (size,) = struct.unpack(">i", await frames.readexactly(4))
        out.append(await frames.readexactly(size))
    return out


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=600), max_size=12),
    cuts=st.lists(st.integers(min_value=1, max_value=700), max_size=40),
)
def test_frames_come_out_whole_however_the_bytes_were_cut(
    payloads: list[bytes], cuts: list[int]
) -> None:
    async def scenario() -> list[bytes]:
        frames, transport = reader()
        stream = framed(payloads)
        pos = 0
        for cut in cuts:
            frames.feed_data(stream[pos : pos + cut])
            pos += cut
        frames.feed_data(stream[pos:])
        frames.feed_eof()
        out = await read_frames(frames, len(payloads))
        assert frames.at_eof()
        assert not transport.paused  # everything read: reading resumed
        return out

    assert asyncio.run(scenario()) == payloads


async def test_a_waiting_reader_gets_a_frame_fed_after_it_started_waiting() -> None:
    frames, transport = reader()
    payload = bytes(range(256)) * 40  # larger than the high-water mark
    read = asyncio.create_task(read_frames(frames, 1))
    stream = framed([payload])
    for start in range(0, len(stream), 100):
        frames.feed_data(stream[start : start + 100])
        await asyncio.sleep(0)
        assert not transport.paused  # the reader waits for this frame: never paused for it
    assert await read == [payload]


async def test_reading_pauses_when_no_one_reads_and_resumes_when_drained() -> None:
    frames, transport = reader()
    frames.feed_data(framed([b"x" * 200]))
    assert transport.paused
    assert transport.pauses == 1
    assert await read_frames(frames, 1) == [b"x" * 200]
    assert not transport.paused


async def test_eof_inside_a_frame_gives_the_partial_bytes() -> None:
    frames, _ = reader()
    frames.feed_data(b"abc")
    frames.feed_eof()
    with pytest.raises(asyncio.IncompleteReadError) as caught:
        await frames.readexactly(5)
    assert caught.value.partial == b"abc"
    assert caught.value.expected == 5
    assert frames.at_eof()


async def test_an_error_reaches_the_waiting_reader() -> None:
    frames, _ = reader()
    read = asyncio.create_task(frames.readexactly(4))
    await asyncio.sleep(0)
    frames.set_exception(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError):
        await read
    assert isinstance(frames.exception(), ConnectionResetError)
    with pytest.raises(ConnectionResetError):
        await frames.readexactly(1)


async def test_a_whole_chunk_is_handed_out_without_a_copy() -> None:
    frames, _ = reader()
    chunk = b"y" * 50
    frames.feed_data(chunk)
    assert await frames.readexactly(50) is chunk


async def test_other_read_methods_are_refused() -> None:
    frames, _ = reader()
    frames.feed_data(b"line\n")
    with pytest.raises(NotImplementedError):
        await frames.readline()
    with pytest.raises(NotImplementedError):
        await frames.read(2)


def test_install_is_idempotent_and_makes_aiokafka_read_frames() -> None:
    install()
    install()
    assert aiokafka.conn.asyncio.StreamReader is FrameReader
    assert aiokafka.conn.asyncio.sleep is asyncio.sleep  # the rest is asyncio's


def test_keep_large_buffers_works_on_linux_glibc() -> None:
    assert keep_large_buffers() is True  # the suite runs on Linux with glibc


def test_glibc_takes_the_decode_threshold_alone() -> None:
    try:
        assert set_allocator(1 << 20) is True  # the worker's setting without fetch buffers
    finally:
        keep_large_buffers()  # as the rest of the suite's process expects


def test_fetch_responses_come_from_the_heap_and_decoded_images_are_mapped() -> None:
    """A full fetch response (records plus protocol headers) is below the mmap
    threshold, so it reuses heap memory; Pillow's image blocks are above it, so a
    decoded image goes back to the system when freed (tests/faults: decode bombs)."""
    assert MAX_FETCH_BYTES + (64 << 10) < MMAP_THRESHOLD
    keep_large_buffers()
    assert _imaging.get_block_size() == IMAGE_BLOCK_BYTES > MMAP_THRESHOLD
    assert TRIM_THRESHOLD >= 3 * MAX_FETCH_BYTES  # the response, its records' copy, values
