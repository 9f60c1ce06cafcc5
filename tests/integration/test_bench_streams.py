"""bench.gpu's camera streams on the real broker: the stream producer processes send every
frame once, each stream keyed by itself onto one partition with its frames in order, and
stamped with the times they were due, a frame interval apart."""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict

import pytest

from bench.gpu.corpus import make_corpus
from bench.gpu.streams import paced_streams
from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import read_topic
from schemas import decode_request, topics_for

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
async def test_each_streams_frames_reach_one_partition_in_order_a_frame_interval_apart(
    client_settings: ClientSettings, kafka_bootstrap: str, model_name: str
) -> None:
    await create_model_topics(client_settings, model_name, partitions=3)
    args = argparse.Namespace(
        chain_streams=3, chain_fps=10.0, kafka_bootstrap=kafka_bootstrap, pin=False
    )

    sent = await paced_streams(args, model_name, make_corpus(32, 24), "cam", frames=4)

    assert sent["offered_fps"] == 30.0
    records = await read_topic(kafka_bootstrap, topics_for(model_name).requests, 12, 30)
    frames: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for record in records:
        meta = decode_request(record.headers, record.key, record.value, 0).meta
        assert meta.stream is not None
        assert meta.seq is not None
        assert record.key == meta.stream.encode()
        frames[meta.stream].append((record.partition, meta.seq, record.timestamp))
    assert sorted(frames) == ["cam-s0", "cam-s1", "cam-s2"]
    for stream in frames.values():
        assert len({partition for partition, _, _ in stream}) == 1
        assert [seq for _, seq, _ in stream] == [0, 1, 2, 3]  # in order on its partition
        due = [timestamp for _, _, timestamp in stream]
        # Each stream's frames are due a frame interval (100 ms) apart: the pace's times,
        # stamped by the producer, whatever the machine's speed.
        assert [b - a for a, b in itertools.pairwise(due)] == pytest.approx([100, 100, 100], abs=2)
