"""OpenAI's API on ``conveyor gateway``, called by the official ``openai`` client against a
real generation worker (the tiny Llama of ``tests.generation_model``: random weights, a
tokenizer trained here), broker and Redis: completions and chats, whole and streamed,
equal what the SDK gets for the same request under greedy decoding; ``/v1/models``
lists the model; an unknown model, a bad parameter, a missing token, back-pressure and
a wait that times out get their statuses in OpenAI's error shape; a caller that
disconnects mid-stream cancels its generation, and a generation cancelled mid-stream
ends it with an error event."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from producers import AsyncClient, ClientSettings
from producers.admin import create_model_topics, delete_model_topics
from producers.testing import Fleet, WorkerConfig, until
from producers.testing.gateway import GatewayProcess
from schemas import ContentType, ErrorCode, Result, Status
from tests.harness import TEST_WORKER_OPTIONS

# One test process runs the module: its LLM worker and gateway start once under pytest -n.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("gateway-openai")]

TOKEN = "openai-test-token"  # a test credential, not a secret
MAX_LAG = 3
PROMPT = "Conveyor serves models from Kafka"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
]
NEW_TOKENS = 16
LONG = 400  # new tokens of a generation that a disconnect cuts short


@pytest.fixture(scope="module")
async def llm(
    kafka_bootstrap: str,
    redis_url: str,
    tiny_llm: Path,
    tmp_path_factory: pytest.TempPathFactory,
    uid_module: str,
) -> AsyncIterator[str]:
    """A generation model served by one worker (with cancellation) for the module."""
    model = f"llm{uid_module}"
    settings = ClientSettings(kafka_bootstrap=kafka_bootstrap)
    await create_model_topics(settings, model, partitions=1)
    options = json.dumps({"max_new_tokens": 450, "default_new_tokens": NEW_TOKENS})
    base = WorkerConfig(
        model,
        kafka_bootstrap,
        redis_url,
        model=f"hf:{tiny_llm}",
        options=(*TEST_WORKER_OPTIONS, "--cancellation", "--model-options", options),
    )
    try:
        async with Fleet(base, tmp_path_factory.mktemp("llm")) as fleet:
            await fleet.start().until_ready(300)
            yield model
    finally:
        await delete_model_topics(settings, model)


@pytest.fixture(scope="module")
def uid_module() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def gateway(
    kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gateway-openai") / "gateway.log"
    process = GatewayProcess(
        kafka_bootstrap,
        redis_url,
        log,
        options=("--max-lag", str(MAX_LAG)),
        env={"CONVEYOR_GATEWAY_TOKEN": TOKEN},
    )
    with process:
        asyncio.run(process.until_ready())
        yield process


@pytest.fixture
async def oa(gateway: GatewayProcess) -> AsyncIterator[AsyncOpenAI]:
    """The official client on the gateway; no retries (a 429 or 504 is what a test checks)."""
    client = AsyncOpenAI(
        base_url=f"http://{gateway.url}/v1", api_key=TOKEN, max_retries=0, timeout=120
    )
    yield client
    await client.close()


async def _sdk(
    client_settings: ClientSettings, model: str, payload: dict[str, Any], new_tokens: int
) -> tuple[str, Result]:
    """What the SDK gets for the same request, greedy: the stream's text, and the result."""
    async with AsyncClient(client_settings) as sdk:
        request_id = await sdk.submit(
            json.dumps(payload).encode(),
            model=model,
            content_type=ContentType.JSON,
            params={"temperature": 0, "max_new_tokens": new_tokens},
        )
        events = [e async for e in sdk.stream(request_id, timeout=120)]
        text = "".join(e.text for e in events if e.type == "chunk")
        return text, await sdk.wait(request_id, timeout=120)


async def _until_listed(oa: AsyncOpenAI, model: str) -> None:
    async def listed() -> bool:
        return model in [m.id async for m in oa.models.list()]

    await until(listed, f"/v1/models lists {model}", 120)


@pytest.mark.timeout(420)
async def test_completions_and_chats_whole_and_streamed_equal_the_sdks(
    llm: str, oa: AsyncOpenAI, client_settings: ClientSettings
) -> None:
    """Greedy: a completion and a chat, whole and streamed, have the text, finish reason
    and token counts the SDK gets for the same request; the streamed chunks join to it."""
    await _until_listed(oa, llm)
    described = await oa.models.retrieve(llm)
    assert (described.id, described.owned_by) == (llm, "conveyor")

    sdk_text, sdk_result = await _sdk(client_settings, llm, {"prompt": PROMPT}, NEW_TOKENS)
    assert sdk_result.status is Status.ok
    want = sdk_result.outputs
    assert sdk_text == want["text"]

    whole = await oa.completions.create(
        model=llm, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
    )
    assert whole.object == "text_completion"
    assert whole.model == llm
    assert whole.choices[0].text == want["text"]
    assert whole.choices[0].finish_reason == want["finish_reason"]
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        want["prompt_tokens"],
        want["completion_tokens"],
    )
    assert whole.usage.total_tokens == want["prompt_tokens"] + want["completion_tokens"]

    stream = await oa.completions.create(
        model=llm,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usages = [], [], []
    async for chunk in stream:
        pieces += [c.text for c in chunk.choices]
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        usages += [chunk.usage] if chunk.usage is not None else []
    assert "".join(pieces) == want["text"]
    assert len(pieces) > 2  # token by token, not the whole text at once
    assert reasons == [want["finish_reason"]]
    assert [u.completion_tokens for u in usages] == [want["completion_tokens"]]

    chat_text, chat_result = await _sdk(client_settings, llm, {"messages": MESSAGES}, 8)
    assert chat_result.status is Status.ok
    chat_want = chat_result.outputs
    assert chat_text == chat_want["text"]
    chat = await oa.chat.completions.create(
        model=llm,
        messages=MESSAGES,
        max_completion_tokens=8,
        temperature=0,
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat_want["text"]
    assert chat.choices[0].finish_reason == chat_want["finish_reason"]
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == chat_want["prompt_tokens"]

    chat_stream = await oa.chat.completions.create(
        model=llm,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    roles, deltas, chat_reasons = [], [], []
    async for part in chat_stream:
        assert part.object == "chat.completion.chunk"
        for choice in part.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            deltas.append(choice.delta.content or "")
            chat_reasons += [choice.finish_reason] if choice.finish_reason else []
    assert roles == ["assistant"]
    assert "".join(deltas) == chat_want["text"]
    assert chat_reasons == [chat_want["finish_reason"]]


@pytest.mark.timeout(300)
async def test_a_retry_with_the_same_id_gets_the_same_answer_whole_or_streamed(
    llm: str, oa: AsyncOpenAI, uid: str, client_settings: ClientSettings
) -> None:
    """``X-Request-Id`` is the idempotency key: a streamed call, then the same id whole
    and streamed again, get one text (the result already there), computed once."""
    await _until_listed(oa, llm)
    headers = {"X-Request-Id": f"oa-{uid}"}
    first = await oa.completions.create(
        model=llm, prompt="Kafka", max_tokens=12, temperature=0, stream=True, extra_headers=headers
    )
    text = "".join([c.choices[0].text async for c in first if c.choices])
    again = await oa.completions.create(
        model=llm, prompt="Kafka", max_tokens=12, temperature=0, extra_headers=headers
    )
    assert again.choices[0].text == text
    assert again.id == f"cmpl-oa-{uid}"
    replay = await oa.completions.create(
        model=llm, prompt="Kafka", max_tokens=12, temperature=0, stream=True, extra_headers=headers
    )
    assert "".join([c.choices[0].text async for c in replay if c.choices]) == text
    async with AsyncClient(client_settings) as sdk:
        result = await sdk.wait(f"oa-{uid}", timeout=10)
    assert result.outputs["text"] == text


@pytest.mark.timeout(300)
async def test_a_sampled_answer_repeats_with_its_seed(llm: str, oa: AsyncOpenAI, uid: str) -> None:
    """Two requests of their own (ids of their own) with one seed sample the same text at
    temperature 1, streamed or whole; another seed samples another."""
    await _until_listed(oa, llm)

    async def sampled(seed: int, n: int, stream: bool = False) -> str:
        headers = {"X-Request-Id": f"seed-{uid}-{n}"}
        common: dict[str, Any] = {"model": llm, "prompt": "Kafka", "max_tokens": 16}
        if not stream:
            done = await oa.completions.create(
                **common, temperature=1.0, seed=seed, extra_headers=headers
            )
            return str(done.choices[0].text)
        chunks = await oa.completions.create(
            **common, temperature=1.0, seed=seed, stream=True, extra_headers=headers
        )
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    first = await sampled(11, 0)
    assert await sampled(11, 1, stream=True) == first
    assert await sampled(11, 2) == first
    assert await sampled(12, 3) != first


@pytest.mark.timeout(300)
async def test_a_caller_that_disconnects_mid_stream_cancels_the_generation(
    llm: str, oa: AsyncOpenAI, uid: str, client_settings: ClientSettings
) -> None:
    """A long streamed generation whose caller closes the stream after a few chunks is
    cancelled: its result is ``cancelled`` after fewer tokens than it asked for."""
    await _until_listed(oa, llm)
    request_id = f"gone-{uid}"
    stream = await oa.completions.create(
        model=llm,
        prompt=PROMPT,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_headers={"X-Request-Id": request_id},
    )
    seen = 0
    async for _chunk in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()
    async with AsyncClient(client_settings) as sdk:
        result = await sdk.wait(request_id, timeout=120)
    assert result.status is Status.error, result
    assert result.error is not None
    assert result.error.code is ErrorCode.cancelled
    made = int(result.error.message.rsplit("after ", 1)[1].split()[0])
    assert 0 < made < LONG


@pytest.mark.timeout(300)
async def test_a_generation_cancelled_mid_stream_ends_it_with_an_error_event(
    llm: str, oa: AsyncOpenAI, uid: str, client_settings: ClientSettings
) -> None:
    """A streamed generation cancelled by someone else after a few chunks: the stream
    ends with OpenAI's error event (the client raises it) carrying the code."""
    await _until_listed(oa, llm)
    request_id = f"stopped-{uid}"
    stream = await oa.chat.completions.create(
        model=llm,
        messages=MESSAGES,
        max_completion_tokens=LONG,
        temperature=0,
        stream=True,
        extra_headers={"X-Request-Id": request_id},
    )
    seen = 0
    async with AsyncClient(client_settings) as sdk:

        async def read_all() -> None:
            nonlocal seen
            async for _chunk in stream:
                seen += 1
                if seen == 3:
                    await sdk.cancel(request_id)

        with pytest.raises(openai.APIError) as stopped:
            await read_all()
        result = await sdk.wait(request_id, timeout=60)
    assert result.error is not None
    assert result.error.code is ErrorCode.cancelled
    assert stopped.value.code == "cancelled"
    assert seen < LONG


@pytest.mark.timeout(300)
async def test_refusals_in_openais_error_shape(
    llm: str, oa: AsyncOpenAI, gateway: GatewayProcess
) -> None:
    """An unknown model 404, bad parameters and bodies 400 naming the parameter, a prompt
    the model can never take 400 before any stream begins, no token 401."""
    await _until_listed(oa, llm)
    with pytest.raises(openai.NotFoundError) as missing:
        await oa.completions.create(model="no-such-model", prompt="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await oa.models.retrieve("no-such-model")

    with pytest.raises(openai.BadRequestError) as many:
        await oa.completions.create(model=llm, prompt="x", n=2)
    assert (many.value.param, many.value.code) == ("n", "bad_request")
    with pytest.raises(openai.BadRequestError) as seeded:
        await oa.chat.completions.create(model=llm, messages=MESSAGES, seed=-1)
    assert seeded.value.param == "seed"
    with pytest.raises(openai.BadRequestError) as hot:
        await oa.completions.create(model=llm, prompt="x", temperature=3)
    assert hot.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        await oa.completions.create(model=llm, prompt="word " * 600, max_tokens=4, stream=True)
    assert long.value.code == "prompt_too_long"

    status, body = _raw_post(gateway, "/v1/chat/completions", b"{not json", TOKEN)
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"

    anonymous = AsyncOpenAI(base_url=f"http://{gateway.url}/v1", api_key="wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as refused:
            await anonymous.completions.create(model=llm, prompt="x")
        assert refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await anonymous.models.list()
    finally:
        await anonymous.close()
    status, body = _raw_post(gateway, "/v1/completions", b"{}", None)
    assert status == 401


@pytest.mark.timeout(120)
async def test_back_pressure_and_timeouts(
    oa: AsyncOpenAI, client_settings: ClientSettings, model_name: str, drop_topics: list[str]
) -> None:
    """A model with topics and no worker: a wait that times out is 504 naming the id; a
    backlog over the gateway's limit is 429 with Retry-After, whole or streamed."""
    busy_model, idle_model = model_name, f"{model_name}t"
    drop_topics += [busy_model, idle_model]
    for model in (busy_model, idle_model):
        await create_model_topics(client_settings, model, partitions=1)
    async with AsyncClient(client_settings) as sdk:
        await sdk.submit_many([b"x"] * (MAX_LAG + 1), model=busy_model, content_type="text/plain")
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as busy:
            await oa.completions.create(model=busy_model, prompt="x", stream=stream)
        assert busy.value.code == "overloaded"
        assert int(busy.value.response.headers["retry-after"]) >= 1

    request_id = f"late-{idle_model}"
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as late:
            await oa.completions.create(
                model=idle_model,
                prompt="x",
                stream=stream,
                extra_headers={"X-Request-Id": request_id, "X-Request-Timeout": "0.5"},
            )
        assert late.value.status_code == 504
        assert late.value.code == "timeout"
        assert request_id in late.value.message


def _raw_post(
    gateway: GatewayProcess, path: str, body: bytes, token: str | None
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        f"http://{gateway.url}{path}", data=body, headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
