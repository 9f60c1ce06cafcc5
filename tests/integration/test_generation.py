"""A generation model served by a real worker, against the real broker and Redis.

``conveyor worker --model hf:FOLDER`` on the CPU, FOLDER a tiny Llama (2 layers, hidden
64, random weights) with a tokenizer trained here (``tests.generation_model``). Greedy
answers equal ``model.generate`` run directly, token for token; each stream's chunks
join to its final text; a cancellation stops a generation early; every bad input and a
passed deadline get their codes; nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from transformers import AutoTokenizer

from producers.admin import create_model_topics
from producers.cli import main
from producers.client import AsyncClient
from producers.settings import ClientSettings
from producers.testing import Fleet, until
from producers.token_stream import StreamEvent
from schemas import ContentType, ErrorCode, Result, Status, consumer_group, topics_for
from tests.generation_model import cancel_mid_stream, greedy_reference
from tests.harness import check, tally_scenario

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = [
    "Conveyor serves models from Kafka",
    "A worker commits offsets",
    "Results go to Redis, first final wins",
]
NEW_TOKENS = 16
LONG = 400  # new tokens of a generation that a cancel cuts short


async def _events(client: AsyncClient, request_id: str) -> list[StreamEvent]:
    return [event async for event in client.stream(request_id, timeout=120)]


def _text(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if e.type == "chunk")


@pytest.mark.timeout(420)
async def test_a_worker_generates_greedy_text_as_generate_does_and_streams_it(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    tiny_llm: Path,
    kafka_admin: AIOKafkaAdminClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await create_model_topics(client_settings, model_name, partitions=2)
    options = json.dumps({"max_new_tokens": 450, "default_new_tokens": NEW_TOKENS})
    worker = workers.start("--cancellation", "--model-options", options, model=f"hf:{tiny_llm}")
    await worker.until_ready(300)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llm)
    ids: list[str] = []
    async with AsyncClient(client_settings) as client:
        # Greedy, through the worker: token for token what generate makes (all at once:
        # they share the engine's steps).
        greedy = [
            await client.submit(
                p.encode(),
                model=model_name,
                content_type=ContentType.TEXT,
                params={"temperature": 0, "token_ids": True},
            )
            for p in PROMPTS
        ]
        chat = await client.submit(
            json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode(),
            model=model_name,
            content_type=ContentType.JSON,
            params={"max_new_tokens": 8, "token_ids": True},
        )
        sampled = await client.submit(
            json.dumps({"prompt": "Kafka"}).encode(),
            model=model_name,
            content_type=ContentType.JSON,
            params={"temperature": 0.8, "top_p": 0.9, "top_k": 20, "stop": ["\n"]},
        )
        ids += [*greedy, chat, sampled]
        for request_id, prompt in zip(greedy, PROMPTS, strict=True):
            events = await _events(client, request_id)
            result = await client.wait(request_id, timeout=120)
            assert result.status is Status.ok, result
            out = result.outputs
            prompt_ids = tokenizer(prompt)["input_ids"]
            reference = greedy_reference(tiny_llm, prompt_ids, NEW_TOKENS)
            assert out["token_ids"] == reference, (prompt, out)
            assert out["prompt_tokens"] == len(prompt_ids)
            assert out["completion_tokens"] == len(reference)
            eos = tokenizer.eos_token_id
            assert out["finish_reason"] == ("stop" if reference[-1] == eos else "length")
            assert out["text"] == tokenizer.decode(reference, skip_special_tokens=True)
            # The stream: one start, chunks that join to the final text, one end.
            assert events[0].type == "start"
            assert events[-1].type == "end"
            assert events[-1].finish_reason == out["finish_reason"]
            assert _text(events) == out["text"]
            assert out["time_to_first_token_ms"] > 0
        chat_result = await client.wait(chat, timeout=120)
        assert chat_result.status is Status.ok, chat_result
        chat_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
        )
        chat_prompt = tokenizer(chat_ids, add_special_tokens=False)["input_ids"]
        assert chat_result.outputs["prompt_tokens"] == len(chat_prompt)
        assert chat_result.outputs["token_ids"] == greedy_reference(tiny_llm, chat_prompt, 8)
        sampled_result = await client.wait(sampled, timeout=120)
        assert sampled_result.status is Status.ok, sampled_result
        assert "\n" not in sampled_result.outputs["text"]
        assert _text(await _events(client, sampled)) == sampled_result.outputs["text"]

        # The CLI: `conveyor submit --stream` prints the text as it comes.
        prompt_file = tmp_path / "prompt.txt"
        prompt_file.write_text(PROMPTS[0])
        argv = [
            *("--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url),
            *("submit", str(prompt_file), "--model", model_name, "--stream"),
            *("--content-type", "text/plain", "--params", '{"temperature": 0}'),
        ]
        capsys.readouterr()
        assert await asyncio.to_thread(main, argv) == 0
        first = (await client.wait(greedy[0], timeout=10)).outputs["text"]
        assert capsys.readouterr().out == first + "\n"

        # A cancel stops a long generation early, and frees its place.
        long_prompt = PROMPTS[0]
        assert len(greedy_reference(tiny_llm, tokenizer(long_prompt)["input_ids"], LONG)) == LONG
        long_id = await client.submit(
            long_prompt.encode(),
            model=model_name,
            content_type=ContentType.TEXT,
            params={"max_new_tokens": LONG},
        )
        ids.append(long_id)
        _, cancelled = await cancel_mid_stream(client, long_id)
        assert cancelled.error is not None
        made = int(cancelled.error.message.rsplit("after ", 1)[1].split()[0])
        assert 0 < made < LONG

        # Bad inputs and a passed deadline: their codes, and no stream.
        bad: dict[str, tuple[bytes, ContentType, dict[str, Any], ErrorCode]] = {
            "png": (b"\x89PNG\r\n\x1a\n", ContentType.PNG, {}, ErrorCode.unsupported_media_type),
            "json": (b"{not json", ContentType.JSON, {}, ErrorCode.decode_failed),
            "shape": (b'{"text": "x"}', ContentType.JSON, {}, ErrorCode.bad_request),
            "temp": (b"hi", ContentType.TEXT, {"temperature": -1}, ErrorCode.bad_request),
            "many": (b"hi", ContentType.TEXT, {"max_new_tokens": 451}, ErrorCode.bad_request),
            "stop": (b"hi", ContentType.TEXT, {"stop": [""]}, ErrorCode.bad_request),
            "long": (b"word " * 600, ContentType.TEXT, {}, ErrorCode.prompt_too_long),
            "fit": (
                b"hi " * 100,
                ContentType.TEXT,
                {"max_new_tokens": 450},
                ErrorCode.prompt_too_long,
            ),
            "roles": (b'{"messages": [{"role": 1}]}', ContentType.JSON, {}, ErrorCode.bad_request),
        }
        refused: dict[str, ErrorCode] = {}
        for payload, media, params, code in bad.values():
            request_id = await client.submit(
                payload, model=model_name, content_type=media, params=params
            )
            refused[request_id] = code
        late = await client.submit(
            b"too late",
            model=model_name,
            content_type=ContentType.TEXT,
            deadline=timedelta(milliseconds=-1),
        )
        refused[late] = ErrorCode.expired
        ids += list(refused)
        for request_id, code in refused.items():
            result = await client.wait(request_id, timeout=120)
            assert result.error is not None, result
            assert result.error.code is code, (code, result)
            assert await _events(client, request_id) == []
        long = await client.result(
            next(i for i, c in refused.items() if c is ErrorCode.prompt_too_long)
        )
        assert isinstance(long, Result)
        assert long.error is not None
        assert "at most 511 prompt tokens" in long.error.message

    tally = await tally_scenario(
        "generation: greedy, sampled, cancelled, refused",
        kafka_bootstrap,
        redis_url,
        model_name,
        ids,
    )
    check(tally, workers.logs())
    assert tally.answered == len(ids)

    # An offset is committed once its result is durable: every request's (and the CLI's).
    requests_topic = topics_for(model_name).requests

    committed: dict[int, int] = {}

    async def all_committed() -> bool:
        offsets = await kafka_admin.list_consumer_group_offsets(consumer_group(model_name))
        committed.update(
            {tp.partition: o.offset for tp, o in offsets.items() if tp.topic == requests_topic}
        )
        return sum(committed.values()) == len(ids) + 1

    await until(all_committed, "every request's offset committed", 60, lambda: str(committed))
