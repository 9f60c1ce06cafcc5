"""OpenAI's answers to generation requests: whole bodies, stream chunks, errors. No I/O.

A whole ``text_completion`` or ``chat.completion`` comes from the result document
(``completion_body``); a stream is its chunks (``Chunks``), each one a server-sent
event (``sse``), the text relayed through ``Resumed`` so that a generation restarted
on another worker never splices two texts. ``error_body`` is OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from producers.gateway.openai_requests import Kind


def response_id(kind: Kind, request_id: str) -> str:
    """OpenAI's ``id`` of the answer to ``request_id``: ``cmpl-<id>``, ``chatcmpl-<id>``."""
    return f"{'cmpl' if kind is Kind.completion else 'chatcmpl'}-{request_id}"


def usage(outputs: Mapping[str, Any]) -> dict[str, int]:
    """OpenAI's ``usage`` from a generation result's ``outputs``."""
    prompt = int(outputs.get("prompt_tokens", 0))
    completion = int(outputs.get("completion_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(
    kind: Kind, request_id: str, model: str, created: int, outputs: Mapping[str, Any]
) -> dict[str, Any]:
    """The whole answer (``stream: false``) from a generation result's ``outputs``."""
    text = str(outputs.get("text", ""))
    choice: dict[str, Any] = {"index": 0}
    if kind is Kind.completion:
        choice["text"] = text
    else:
        choice["message"] = {"role": "assistant", "content": text}
    choice["logprobs"] = None
    choice["finish_reason"] = outputs.get("finish_reason")
    return {
        "id": response_id(kind, request_id),
        "object": str(kind),
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(outputs),
    }


class Chunks:
    """The chunks of one streamed answer, in OpenAI's shapes (``chat.completion.chunk``,
    or ``text_completion`` for a completion)."""

    def __init__(
        self, kind: Kind, request_id: str, model: str, created: int, include_usage: bool
    ) -> None:
        self._kind = kind
        self._head = {
            "id": response_id(kind, request_id),
            "object": "chat.completion.chunk" if kind is Kind.chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._include_usage = include_usage

    def first(self) -> dict[str, Any] | None:
        """A chat stream's first chunk says the role; a completion's has none."""
        if self._kind is not Kind.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def text(self, text: str) -> dict[str, Any]:
        """The next piece of the text."""
        return self._chunk({"content": text} if self._kind is Kind.chat else text, None)

    def finish(self, finish_reason: str | None) -> dict[str, Any]:
        """The last chunk of the choice: no text, its ``finish_reason``."""
        return self._chunk({} if self._kind is Kind.chat else "", finish_reason)

    def usage(self, outputs: Mapping[str, Any]) -> dict[str, Any] | None:
        """With ``include_usage``: the chunk after the last, no choices, the usage."""
        if not self._include_usage:
            return None
        return {**self._head, "choices": [], "usage": usage(outputs)}

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if isinstance(delta, str):
            choice["text"] = delta
        else:
            choice["delta"] = delta
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return chunk


def sse(document: Mapping[str, Any] | None) -> bytes:
    """One server-sent event: ``data: <JSON>``, or ``data: [DONE]`` for None."""
    data = b"[DONE]" if document is None else orjson.dumps(document)
    return b"data: " + data + b"\n\n"


class Diverged(Exception):
    """A restarted generation's text left the text already streamed."""


class Resumed:
    """The text streamed so far, against a generation that restarts on another worker.

    The stream says so (a second ``start``): the text of the run before is void. What a
    caller already has cannot be taken back, so the new run's text is held until it
    passes what was sent, and only the rest goes out; a greedy run makes the same text
    again, so its caller never sees the restart. A new run that differs (a sampled one)
    raises ``Diverged``: the stream then ends with an error rather than splice two texts.
    """

    def __init__(self) -> None:
        self.sent = ""
        self._run = ""

    def restart(self) -> None:
        """A new run began: its text starts again from nothing."""
        self._run = ""

    def add(self, text: str) -> str:
        """The part of the run's next piece that is new to the caller (maybe empty)."""
        self._run += text
        if len(self._run) <= len(self.sent):
            if not self.sent.startswith(self._run):
                raise Diverged
            return ""
        if not self._run.startswith(self.sent):
            raise Diverged
        new = self._run[len(self.sent) :]
        self.sent = self._run
        return new


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
_TYPES |= {404: "invalid_request_error", 409: "invalid_request_error"}
_TYPES |= {413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; ``code`` is Conveyor's (``unknown_model``, ``overloaded``...)."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_entry(name: str, created: int) -> dict[str, Any]:
    """One model of ``GET /v1/models``."""
    return {"id": name, "object": "model", "created": created, "owned_by": "conveyor"}
