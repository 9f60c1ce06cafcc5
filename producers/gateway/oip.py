"""The Open Inference Protocol's HTTP/REST bodies, read and written: no I/O here.

An infer request is a JSON object (``id``, ``parameters``, ``inputs``, ``outputs``),
optionally followed by binary tensor data (Triton's binary tensor extension, which
tritonclient uses by default for BYTES): the ``Inference-Header-Content-Length``
header says where the JSON ends, each input with binary data says its size in
``parameters.binary_data_size``, and a BYTES tensor is its elements one after
another, each a 4-byte little-endian length and then its bytes.

The gateway serves a model through one input and one kind of output:

- the input, of any name: a BYTES tensor, each element one request's payload (an
  image's bytes, or text); or a numeric tensor of shape ``[N, ...]``, each of its N
  rows one request, sent as an ``application/x-npy`` array;
- ``OUTPUT``: a BYTES tensor of the input's shape (``[N]`` for a numeric input), each
  element the JSON of one request's ``outputs``, whatever the task;
- for a classifier, any requested output with ``parameters.classification: K`` is
  Triton's classification extension instead: BYTES of shape ``[N, K]``, each element
  ``"score:index:label"``, best first.

``parse_infer`` reads a request into an ``InferCall``; ``encode_infer`` writes the
answer, as JSON or (when asked) JSON followed by binary data.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

OUTPUT = "OUTPUT"
"""The name of the output that carries each request's result ``outputs`` as JSON."""
HEADER_LENGTH = "inference-header-content-length"
"""The binary extension's header: how many bytes of the body are the JSON."""
_RESERVED = frozenset(
    {
        "timeout",
        "binary_data_output",
        "priority",
        "sequence_id",
        "sequence_start",
        "sequence_end",
    }
)
"""Request parameters the protocol defines; the rest are the model's (``ce_params``)."""
_NUMERIC: dict[str, tuple[str, str]] = {
    # OIP datatype: (npy descr, struct format)
    "BOOL": ("|b1", "?"),
    "UINT8": ("|u1", "B"),
    "UINT16": ("<u2", "H"),
    "UINT32": ("<u4", "I"),
    "UINT64": ("<u8", "Q"),
    "INT8": ("|i1", "b"),
    "INT16": ("<i2", "h"),
    "INT32": ("<i4", "i"),
    "INT64": ("<i8", "q"),
    "FP16": ("<f2", "e"),
    "FP32": ("<f4", "f"),
    "FP64": ("<f8", "d"),
}
_LENGTH = struct.Struct("<I")


class ProtocolError(ValueError):
    """A request body the protocol (or the gateway's use of it) refuses: answered 400."""


@dataclass(frozen=True)
class RequestedOutput:
    """One entry of a request's ``outputs``."""

    name: str
    binary: bool
    classification: int | None  # Triton's classification extension: the top K


@dataclass(frozen=True)
class InferCall:
    """One infer request, read."""

    payloads: list[bytes]
    """One payload per request, in order."""
    content_type: str | None
    """The input's ``parameters.content_type``, if given (else sniffed or text)."""
    text: bool
    """The payloads came as JSON strings (text), not bytes."""
    shape: list[int]
    """The shape of each output carrying one element per request."""
    id: str | None
    timeout_us: int | None
    """The client's timeout (``parameters.timeout``), microseconds."""
    params: dict[str, Any]
    """The request's own parameters, sent as ``ce_params``."""
    outputs: list[RequestedOutput] = field(default_factory=list)
    """What the response carries; empty: ``OUTPUT`` alone."""


def parse_infer(body: bytes, header_length: int | None, max_requests: int) -> InferCall:
    """Read an infer request's body; ``header_length``: the binary extension's header.

    Raises ``ProtocolError`` naming the field at fault.
    """
    if header_length is not None and not 0 < header_length <= len(body):
        raise ProtocolError(
            f"Inference-Header-Content-Length {header_length} does not fit a body of "
            f"{len(body)} bytes"
        )
    head, binary = (body, b"") if header_length is None else _split(body, header_length)
    try:
        document = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"the request is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ProtocolError("the request must be a JSON object")
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise ProtocolError(
            "inputs must hold exactly one tensor: a model served through Conveyor takes "
            "one payload per request"
        )
    parameters = _object(document.get("parameters"), "parameters")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError("id must be a string")
    payloads, shape, text, content_type = _read_input(inputs[0], binary, max_requests)
    return InferCall(
        payloads=payloads,
        content_type=content_type,
        text=text,
        shape=shape,
        id=request_id or None,
        timeout_us=_timeout(parameters.get("timeout")),
        params={k: v for k, v in parameters.items() if k not in _RESERVED},
        outputs=_requested(document.get("outputs"), bool(parameters.get("binary_data_output"))),
    )


def _split(body: bytes, header_length: int) -> tuple[bytes, bytes]:
    return body[:header_length], body[header_length:]


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    return value


def _timeout(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProtocolError("parameters.timeout must be a positive integer of microseconds")
    return value


def _read_input(
    tensor: dict[str, Any], binary: bytes, max_requests: int
) -> tuple[list[bytes], list[int], bool, str | None]:
    """(payloads, output shape, text, content type) of the one input."""
    name = tensor.get("name")
    datatype = tensor.get("datatype")
    shape = tensor.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise ProtocolError("an input needs a name and a datatype")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"input {name}: shape must be a list of sizes, e.g. [1]")
    parameters = _object(tensor.get("parameters"), f"input {name} parameters")
    content_type = parameters.get("content_type")
    if content_type is not None and not isinstance(content_type, str):
        raise ProtocolError(f"input {name}: parameters.content_type must be a media type")
    size = parameters.get("binary_data_size")
    if size is not None and (not isinstance(size, int) or size != len(binary)):
        raise ProtocolError(
            f"input {name}: binary_data_size {size} but {len(binary)} bytes follow the JSON"
        )
    data = binary if size is not None else tensor.get("data")
    if data is None:
        raise ProtocolError(f"input {name}: no data, and no binary_data_size")
    if datatype == "BYTES":
        payloads, text = _bytes_elements(name, data)
        out_shape = shape
    elif datatype in _NUMERIC:
        payloads, text, out_shape = _rows(name, datatype, shape, data), False, shape[:1]
    else:
        raise ProtocolError(f"input {name}: datatype {datatype} is not one the gateway takes")
    count = math.prod(out_shape)
    if len(payloads) != count:
        raise ProtocolError(f"input {name}: shape {shape} but {len(payloads)} elements")
    if not 0 < count <= max_requests:
        raise ProtocolError(
            f"input {name}: {count} requests in one call; the gateway takes 1 to {max_requests}"
        )
    return payloads, out_shape, text, content_type


def _bytes_elements(name: str, data: Any) -> tuple[list[bytes], bool]:
    if isinstance(data, bytes):
        return _deserialize_bytes(name, data), False
    flat = _flatten(data)
    if not all(isinstance(item, str) for item in flat):
        raise ProtocolError(
            f"input {name}: BYTES data in JSON must be strings (send images as binary data)"
        )
    return [item.encode() for item in flat], True


def _deserialize_bytes(name: str, data: bytes) -> list[bytes]:
    elements = []
    offset = 0
    view = memoryview(data)
    while offset < len(data):
        if offset + 4 > len(data):
            raise ProtocolError(f"input {name}: binary BYTES data ends inside a length")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(data):
            raise ProtocolError(f"input {name}: a BYTES element of {length} bytes is cut short")
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    return elements


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    for item in data:
        flat.extend(_flatten(item))
    return flat


def _rows(name: str, datatype: str, shape: list[int], data: Any) -> list[bytes]:
    """Each row of a numeric tensor ``[N, ...]`` as an npy array of shape ``[...]``."""
    descr, code = _NUMERIC[datatype]
    item_shape = shape[1:]
    per_row = math.prod(item_shape)
    width = struct.calcsize(code)
    if isinstance(data, bytes):
        raw = data
        if len(raw) != math.prod(shape) * width:
            raise ProtocolError(
                f"input {name}: {len(raw)} bytes of {datatype} data for shape {shape}"
            )
    else:
        flat = _flatten(data)
        if len(flat) != math.prod(shape):
            raise ProtocolError(f"input {name}: shape {shape} but {len(flat)} elements")
        try:
            raw = struct.pack(f"<{len(flat)}{code}", *flat)
        except struct.error as exc:
            raise ProtocolError(f"input {name}: data is not {datatype}: {exc}") from None
    header = _npy_header(descr, item_shape)
    step = per_row * width
    return [header + raw[i * step : (i + 1) * step] for i in range(shape[0])]


def _npy_header(descr: str, shape: Sequence[int]) -> bytes:
    """The npy format 1.0 header of a C-ordered array (NumPy's own layout, without NumPy)."""
    dims = "".join(f"{d}," for d in shape) if len(shape) == 1 else ", ".join(map(str, shape))
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({dims}), }}"
    # Magic (6) + version (2) + length (2) + text + newline, padded to a multiple of 64.
    padding = -(10 + len(text) + 1) % 64
    encoded = (text + " " * padding + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(encoded)) + encoded


def _requested(value: Any, binary_default: bool) -> list[RequestedOutput]:
    if value is None:
        return [RequestedOutput(OUTPUT, binary_default, None)]
    if not isinstance(value, list):
        raise ProtocolError("outputs must be a list")
    requested = []
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ProtocolError("each requested output needs a name")
        parameters = _object(entry.get("parameters"), f"output {entry['name']} parameters")
        top = parameters.get("classification")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise ProtocolError(f"output {entry['name']}: classification must be a positive count")
        if top is None and entry["name"] != OUTPUT:
            raise ProtocolError(
                f"output {entry['name']} is not one the gateway serves: ask for {OUTPUT}, "
                "or for any name with parameters.classification (a classifier's top K)"
            )
        binary = parameters.get("binary_data", binary_default)
        requested.append(RequestedOutput(entry["name"], bool(binary), top))
    return requested


@dataclass(frozen=True)
class OutputTensor:
    """One output of a response: BYTES elements and their shape."""

    name: str
    shape: list[int]
    elements: list[bytes]
    binary: bool


def result_outputs(
    requested: Sequence[RequestedOutput], shape: list[int], outputs: Sequence[Any]
) -> list[OutputTensor]:
    """The response tensors for the requests' result ``outputs`` (in request order)."""
    tensors = []
    for entry in requested:
        if entry.classification is None:
            elements = [orjson.dumps(o) for o in outputs]
            tensors.append(OutputTensor(entry.name, shape, elements, entry.binary))
            continue
        k = entry.classification
        rows = [_classes(o, k) for o in outputs]
        width = min((len(r) for r in rows), default=0)
        flat = [element for row in rows for element in row[:width]]
        tensors.append(OutputTensor(entry.name, [len(rows), width], flat, entry.binary))
    return tensors


def _classes(outputs: Any, k: int) -> list[bytes]:
    """A classification result as Triton's ``"score:index:label"`` strings, best first:
    an image classifier's list of classes, or a text classifier's document of them."""
    if isinstance(outputs, dict) and isinstance(outputs.get("labels"), list):
        outputs = outputs["labels"]
    if not isinstance(outputs, list) or not all(
        isinstance(c, dict) and {"score", "index", "label"} <= c.keys() for c in outputs
    ):
        raise ProtocolError(
            "parameters.classification asks for classes, and this model's outputs are not "
            "a classification (a list of {label, index, score}): ask for OUTPUT instead"
        )
    return [f"{c['score']}:{c['index']}:{c['label']}".encode() for c in outputs[:k]]


def encode_infer(
    model: str, version: str, request_id: str, tensors: Sequence[OutputTensor]
) -> tuple[bytes, int | None]:
    """The response body, and the JSON's length when binary data follows it."""
    described = []
    chunks: list[bytes] = []
    for tensor in tensors:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": "BYTES", "shape": tensor.shape}
        if tensor.binary:
            raw = b"".join(_LENGTH.pack(len(e)) + e for e in tensor.elements)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = [e.decode("utf-8", errors="replace") for e in tensor.elements]
        described.append(entry)
    head = orjson.dumps(
        {"model_name": model, "model_version": version, "id": request_id, "outputs": described}
    )
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)


def wants_classes(call: InferCall) -> int | None:
    """The largest K a classification output asks for, if any (the requests' ``top_k``)."""
    counts = [o.classification for o in call.outputs if o.classification is not None]
    return max(counts) if counts else None


def model_metadata(
    name: str, version: str, task: str, content_types: Sequence[str], labels: int | None
) -> dict[str, Any]:
    """The metadata document of a model served through the gateway."""
    parameters: Mapping[str, Any] = {"task": task, "content_types": list(content_types)}
    if labels is not None:
        parameters = {**parameters, "labels": labels}
    return {
        "name": name,
        "versions": [version],
        "platform": "conveyor",
        "inputs": [{"name": "INPUT", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": OUTPUT, "datatype": "BYTES", "shape": [-1]}],
        "parameters": parameters,
    }
