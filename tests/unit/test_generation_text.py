"""The pure parts of generation: a request's checks (``workers.generation.requests``)
and the output processor (``workers.generation.outputs``): chunks that join to the final
text, stop strings held back and cut, incomplete characters held back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import ContentType, ContractError, ErrorCode
from workers.generation.outputs import LENGTH, Detokenized, final
from workers.generation.requests import Limits, parse_prompt

LIMITS = Limits(max_prompt_tokens=10, max_new_tokens=20, default_new_tokens=5, max_total_tokens=24)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def chat(messages: list[dict[str, str]]) -> list[int]:
    return encode("".join(f"<{m['role']}>{m['content']}" for m in messages))


def parse(payload: bytes, media: ContentType = ContentType.TEXT, **params: Any) -> Any:
    return parse_prompt(payload, media, params, LIMITS, encode, chat)


def test_a_text_prompt_json_prompt_and_messages_become_token_ids() -> None:
    assert parse(b"abc").token_ids == [97, 98, 99]
    assert parse(b'{"prompt": "ab"}', ContentType.JSON).token_ids == [97, 98]
    messages = json.dumps({"messages": [{"role": "u", "content": "hi"}]}).encode()
    assert parse(messages, ContentType.JSON).token_ids == encode("<u>hi")
    prompt = parse(b"a", temperature=0.5, top_p=0.9, top_k=3, stop="x", seed=7)
    assert prompt.max_new_tokens == LIMITS.default_new_tokens
    assert (prompt.sampling.temperature, prompt.sampling.top_p, prompt.sampling.top_k) == (
        0.5,
        0.9,
        3,
    )
    assert prompt.stop == ("x",)
    assert parse(b"a").sampling.greedy


@pytest.mark.parametrize(
    ("payload", "media", "params", "code", "field"),
    [
        (b"x", ContentType.PNG, {}, ErrorCode.unsupported_media_type, "content-type"),
        (b"\xff", ContentType.TEXT, {}, ErrorCode.decode_failed, "payload"),
        (b"{", ContentType.JSON, {}, ErrorCode.decode_failed, "payload"),
        (b'{"prompt": 1}', ContentType.JSON, {}, ErrorCode.bad_request, "payload.prompt"),
        (
            b'{"prompt": "a", "messages": []}',
            ContentType.JSON,
            {},
            ErrorCode.bad_request,
            "payload",
        ),
        (b'{"messages": []}', ContentType.JSON, {}, ErrorCode.bad_request, "payload.messages"),
        (b"", ContentType.TEXT, {}, ErrorCode.bad_request, "prompt"),
        (
            b"a",
            ContentType.TEXT,
            {"max_new_tokens": 0},
            ErrorCode.bad_request,
            "params.max_new_tokens",
        ),
        (
            b"a",
            ContentType.TEXT,
            {"max_new_tokens": 21},
            ErrorCode.bad_request,
            "params.max_new_tokens",
        ),
        (
            b"a",
            ContentType.TEXT,
            {"temperature": "hot"},
            ErrorCode.bad_request,
            "params.temperature",
        ),
        (b"a", ContentType.TEXT, {"top_p": 0}, ErrorCode.bad_request, "params.top_p"),
        (b"a", ContentType.TEXT, {"top_k": -1}, ErrorCode.bad_request, "params.top_k"),
        (b"a", ContentType.TEXT, {"seed": True}, ErrorCode.bad_request, "params.seed"),
        (b"a", ContentType.TEXT, {"stop": [1]}, ErrorCode.bad_request, "params.stop"),
        (b"a" * 11, ContentType.TEXT, {}, ErrorCode.prompt_too_long, "prompt"),
        (
            b"a" * 10,
            ContentType.TEXT,
            {"max_new_tokens": 15},
            ErrorCode.prompt_too_long,
            "params.max_new_tokens",
        ),
    ],
)
def test_each_bad_request_is_refused_with_its_code_and_field(
    payload: bytes, media: ContentType, params: dict[str, Any], code: ErrorCode, field: str
) -> None:
    with pytest.raises(ContractError) as refused:
        parse(payload, media, **params)
    assert (refused.value.code, refused.value.field) == (code, field)


def test_a_prompt_that_can_never_fit_is_refused_with_its_numbers() -> None:
    with pytest.raises(ContractError, match="the prompt is 11 tokens; this model takes at most 10"):
        parse(b"a" * 11)


def test_a_model_without_a_chat_template_refuses_messages() -> None:
    body = json.dumps({"messages": [{"role": "u", "content": "hi"}]}).encode()
    with pytest.raises(ContractError, match="no chat template"):
        parse_prompt(body, ContentType.JSON, {}, LIMITS, encode, None)


def decode(ids: list[int]) -> str:
    """Token i is the character chr(i); 0xFFFD stands for half a character."""
    return "".join(chr(i) for i in ids)


def stream(
    tokens: list[int], stops: tuple[str, ...] = (), eos: tuple[int, ...] = ()
) -> tuple[list[str], Detokenized]:
    text = Detokenized(decode, stops, eos)
    chunks = []
    for n in range(1, len(tokens) + 1):
        step = text.update(tokens[:n])
        chunks.append(step.chunk)
        if step.stopped is not None:
            return chunks, text
    chunks.append(text.finish())
    return chunks, text


def test_chunks_join_to_the_final_text() -> None:
    chunks, text = stream(encode("hello world"))
    assert "".join(chunks) == text.text == "hello world"
    assert chunks[0] == "h"  # sent as made: nothing held back without stop strings


def test_a_stop_string_is_held_back_until_it_cannot_start_and_is_cut() -> None:
    chunks, text = stream(encode("say END now"), stops=("END",))
    assert text.stopped == "END"
    assert text.text == "say "
    assert "".join(chunks) == "say "
    assert "E" not in "".join(chunks)


def test_a_tail_that_was_not_a_stop_is_sent_after_all() -> None:
    chunks, text = stream(encode("an ENd"), stops=("END",))
    assert text.stopped is None
    assert "".join(chunks) == "an ENd"


def test_an_incomplete_character_waits_for_its_next_token() -> None:
    text = Detokenized(decode, (), ())
    assert text.update([97, 0xFFFD]).chunk == "a"
    assert text.update([97, 98]).chunk == "b"


def test_the_end_of_sequence_token_counts_but_is_not_text() -> None:
    _, text = stream([104, 105, 1], eos=(1,))
    assert text.text == "hi"
    out = final(
        text,
        prompt_tokens=3,
        finish_reason=LENGTH,
        created_s=1.0,
        timestamps=[1.5, 1.75, 2.0],
        attempt=2,
    )
    assert out["completion_tokens"] == 3
    assert out["time_to_first_token_ms"] == 500.0
    assert out["time_between_tokens_ms"] == {"mean": 250.0, "p50": 250.0, "max": 250.0}
    assert out["attempt"] == 2
    assert "token_ids" not in out
