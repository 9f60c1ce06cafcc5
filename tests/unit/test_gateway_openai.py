"""OpenAI's bodies as generation requests and back (``producers.gateway.openai_requests`` and
``openai_answers``): the
parameters each route maps, what it refuses by name, the shapes of whole answers and
of stream chunks, and a restarted stream that never splices two texts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from producers.gateway.openai_answers import (
    Chunks,
    Diverged,
    Resumed,
    completion_body,
    error_body,
    sse,
)
from producers.gateway.openai_requests import (
    BadRequest,
    Kind,
    parse_body,
    parse_chat,
    parse_completion,
)

OUTPUTS = {"text": "Hello", "finish_reason": "length", "prompt_tokens": 5, "completion_tokens": 3}


def test_a_completion_maps_its_parameters() -> None:
    generation = parse_completion(
        {
            "model": "tiny",
            "prompt": "Once",
            "max_tokens": 12,
            "temperature": 0,
            "top_p": 0.5,
            "stop": "\n",
            "seed": 7,
            "n": 1,
            "user": "someone",
        }
    )
    assert (generation.kind, generation.model, generation.stream) == (
        Kind.completion,
        "tiny",
        False,
    )
    assert json.loads(generation.payload) == {"prompt": "Once"}
    assert generation.params == {
        "temperature": 0.0,
        "max_new_tokens": 12,
        "top_p": 0.5,
        "stop": ["\n"],
        "seed": 7,
    }


def test_openai_defaults_sample_at_temperature_one() -> None:
    """OpenAI's default temperature is 1; max_tokens absent leaves the worker's default."""
    assert parse_completion({"model": "m", "prompt": ["only one"]}).params == {"temperature": 1.0}


def test_a_chat_maps_messages_and_max_completion_tokens() -> None:
    generation = parse_chat(
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_tokens": 99,
            "max_completion_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert json.loads(generation.payload) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
        ]
    }
    assert generation.params["max_new_tokens"] == 8  # max_completion_tokens wins
    assert (generation.stream, generation.include_usage) == (True, True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": [1, 2, 3]}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": "x", "n": 2}, "n"),
        ({"model": "m", "prompt": "x", "n": True}, "n"),
        ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "seed": -3}, "seed"),
        ({"model": "m", "prompt": "x", "seed": "3"}, "seed"),
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"model": "m", "prompt": "x", "messages": []}, "messages"),  # a chat field
    ],
)
def test_a_completion_refuses_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_completion(body)
    assert refused.value.param == param
    assert str(refused.value)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0]",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
            "messages[0].tool_calls",
        ),
    ],
)
def test_a_chat_refuses_bad_messages_by_name(messages: Any, param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_chat({"model": "m", "messages": messages})
    assert refused.value.param == param


def test_a_chat_refuses_tools() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]})
    assert refused.value.param == "tools"
    # Sent at their no-op values (as some clients always do), they are taken.
    parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [],
            "logprobs": False,
            "frequency_penalty": 0,
            "response_format": {"type": "text"},
        }
    )


def test_a_body_that_is_no_json_object_is_refused() -> None:
    for body in (b"{nope", b"[1, 2]"):
        with pytest.raises(BadRequest) as refused:
            parse_body(body)
        assert refused.value.param is None


def test_whole_answers_in_openais_shapes() -> None:
    completion = completion_body(Kind.completion, "r1", "tiny", 1700000000, OUTPUTS)
    assert completion == {
        "id": "cmpl-r1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    chat = completion_body(Kind.chat, "r1", "tiny", 1700000000, OUTPUTS)
    assert (chat["id"], chat["object"]) == ("chatcmpl-r1", "chat.completion")
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


def test_chat_chunks_say_the_role_then_the_text_then_the_reason_then_the_usage() -> None:
    chunks = Chunks(Kind.chat, "r1", "tiny", 1, include_usage=True)
    first = chunks.first()
    assert first is not None
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None
    assert chunks.text("He")["choices"][0]["delta"] == {"content": "He"}
    last = chunks.finish("stop")["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({}, "stop")
    usage = chunks.usage(OUTPUTS)
    assert usage is not None
    assert (usage["choices"], usage["usage"]["total_tokens"]) == ([], 8)


def test_completion_chunks_carry_text_and_no_usage_unless_asked() -> None:
    chunks = Chunks(Kind.completion, "r1", "tiny", 1, include_usage=False)
    assert chunks.first() is None
    chunk = chunks.text("He")
    assert (chunk["object"], chunk["choices"][0]["text"]) == ("text_completion", "He")
    assert "usage" not in chunk
    assert chunks.usage(OUTPUTS) is None


def test_server_sent_events() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse(None) == b"data: [DONE]\n\n"


def test_a_restarted_run_sends_only_what_passes_the_text_already_sent() -> None:
    resumed = Resumed()
    assert [resumed.add(t) for t in ("Once", " upon")] == ["Once", " upon"]
    resumed.restart()  # generated again, greedy: the same text comes again
    assert [resumed.add(t) for t in ("Once u", "pon a", " time")] == ["", " a", " time"]
    assert resumed.sent == "Once upon a time"


def test_a_restarted_run_that_differs_is_never_spliced() -> None:
    resumed = Resumed()
    resumed.add("Once upon")
    resumed.restart()
    with pytest.raises(Diverged):
        resumed.add("Twice")
    resumed = Resumed()
    resumed.add("Once")
    resumed.restart()
    assert resumed.add("On") == ""
    with pytest.raises(Diverged):
        resumed.add("ly")  # "Only": shorter than the text sent, and not its start
    assert resumed.sent == "Once"


def test_errors_in_openais_shape() -> None:
    assert error_body(404, "model_not_found", "no model x", "model") == {
        "error": {
            "message": "no model x",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error_body(429, "overloaded", "later")["error"]["type"] == "rate_limit_error"
    assert error_body(504, "timeout", "later")["error"]["type"] == "server_error"
