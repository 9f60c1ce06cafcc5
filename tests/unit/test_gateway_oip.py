"""The gateway's Open Inference Protocol bodies, checked against tritonclient's own
encoder and decoder (a client no one here wrote) and against NumPy's npy reader."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton

from producers.gateway.oip import (
    OUTPUT,
    ProtocolError,
    encode_infer,
    model_metadata,
    parse_infer,
    result_outputs,
    wants_classes,
)

CLASSES = [
    {"label": "7", "index": 7, "score": 0.9},
    {"label": "1", "index": 1, "score": 0.05},
    {"label": "9", "index": 9, "score": 0.01},
]


def _triton_body(
    inputs: list[triton.InferInput],
    outputs: list[triton.InferRequestedOutput] | None = None,
    **options: Any,
) -> tuple[bytes, int | None]:
    body, length = triton.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, **options
    )
    return body, length


def test_binary_bytes_inputs_as_tritonclient_sends_them() -> None:
    """Each BYTES element is one payload; the id, the timeout and the model's own
    parameters come through, the protocol's own parameters do not."""
    payloads = [b"\x89PNG first", b"", b"\xff\xd8 third"]
    tensor = triton.InferInput("INPUT", [3], "BYTES")
    tensor.set_data_from_numpy(np.array(payloads, dtype=np.object_))
    body, length = _triton_body(
        [tensor], request_id="r-1", timeout=250_000, parameters={"top_k": 2}
    )
    call = parse_infer(body, length, max_requests=8)
    assert call.payloads == payloads
    assert (call.id, call.timeout_us, call.params) == ("r-1", 250_000, {"top_k": 2})
    assert call.shape == [3]
    assert not call.text
    assert [o.name for o in call.outputs] == [OUTPUT]
    assert call.outputs[0].binary  # tritonclient asks for binary outputs when it names none


def test_json_strings_are_text() -> None:
    document = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": [["a"], ["b"]]}]
    }
    call = parse_infer(json.dumps(document).encode(), None, max_requests=8)
    assert call.payloads == [b"a", b"b"]
    assert call.text
    assert call.shape == [2, 1]
    assert not call.outputs[0].binary


@pytest.mark.parametrize("binary", [True, False])
def test_numeric_rows_become_npy_arrays(binary: bool) -> None:
    """A float tensor [N, 2, 3] is N requests, each the npy of its (2, 3) row."""
    rows = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3) / 7
    tensor = triton.InferInput("features", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows, binary_data=binary)
    body, length = _triton_body([tensor])
    call = parse_infer(body, length, max_requests=8)
    assert call.shape == [2]
    for payload, row in zip(call.payloads, rows, strict=True):
        loaded = np.load(io.BytesIO(payload))
        assert loaded.dtype == np.float32
        np.testing.assert_array_equal(loaded, row)


def test_a_vector_row_is_a_one_dimensional_npy() -> None:
    tensor = triton.InferInput("x", [1, 4], "INT64")
    tensor.set_data_from_numpy(np.array([[1, -2, 3, 4]], dtype=np.int64))
    body, length = _triton_body([tensor])
    (payload,) = parse_infer(body, length, max_requests=8).payloads
    np.testing.assert_array_equal(np.load(io.BytesIO(payload)), [1, -2, 3, 4])


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ({"inputs": []}, "exactly one tensor"),
        ({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [2], "data": ["x"]}]}, "shape"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": ["x"]}]}, "FP32"),
        ({"inputs": [{"name": "a", "datatype": "BF16", "shape": [1], "data": [1]}]}, "BF16"),
        ({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [0], "data": []}]}, "1 to 4"),
        (
            {"inputs": [{"name": "a", "datatype": "BYTES", "shape": [5], "data": list("abcde")}]},
            "1 to 4",
        ),
        ({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": [1]}]}, "strings"),
        (
            {
                "inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
                "parameters": {"timeout": -1},
            },
            "timeout",
        ),
        (
            {
                "inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
                "outputs": [{"name": "scores"}],
            },
            "not one the gateway serves",
        ),
    ],
)
def test_refusals_name_the_fault(document: dict[str, Any], says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        parse_infer(json.dumps(document).encode(), None, max_requests=4)


def test_binary_data_cut_short_is_refused() -> None:
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "a",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": 6},
                }
            ]
        }
    ).encode()
    body = head + b"\x09\x00\x00\x00ab"  # says 9 bytes, has 2
    with pytest.raises(ProtocolError, match="cut short"):
        parse_infer(body, len(head), max_requests=4)
    with pytest.raises(ProtocolError, match="does not fit"):
        parse_infer(body, len(body) + 1, max_requests=4)


@pytest.mark.parametrize("binary", [True, False])
def test_responses_read_back_with_tritonclient(binary: bool) -> None:
    """OUTPUT (each result's outputs as JSON) and the classification extension
    (``score:index:label``, best first), as tritonclient's InferResult reads them."""
    document = {
        "inputs": [{"name": "a", "datatype": "BYTES", "shape": [2], "data": ["x", "y"]}],
        "outputs": [
            {"name": OUTPUT, "parameters": {"binary_data": binary}},
            {"name": "top", "parameters": {"classification": 2, "binary_data": binary}},
        ],
    }
    call = parse_infer(json.dumps(document).encode(), None, max_requests=4)
    assert wants_classes(call) == 2
    tensors = result_outputs(call.outputs, call.shape, [CLASSES, CLASSES[1:]])
    body, length = encode_infer("digits", "v1", "r-2", tensors)
    assert (length is not None) == binary
    answer = triton.InferResult.from_response_body(body, header_length=length)
    assert answer.get_response()["id"] == "r-2"
    assert answer.get_response()["model_version"] == "v1"
    outputs = [json.loads(element) for element in answer.as_numpy(OUTPUT)]
    assert outputs == [CLASSES, CLASSES[1:]]
    top = answer.as_numpy("top")
    assert top.shape == (2, 2)
    first = top[0] if binary else [element.encode() for element in top[0]]
    assert list(first) == [b"0.9:7:7", b"0.05:1:1"]


def test_classes_of_a_model_that_does_not_classify_are_refused() -> None:
    document = {
        "inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
        "outputs": [{"name": "top", "parameters": {"classification": 1}}],
    }
    call = parse_infer(json.dumps(document).encode(), None, max_requests=4)
    with pytest.raises(ProtocolError, match="not a classification"):
        result_outputs(call.outputs, call.shape, [{"boxes": []}])


def test_metadata_says_the_task() -> None:
    metadata = model_metadata("digits", "v1", "classification", ["image/png"], 10)
    assert metadata["versions"] == ["v1"]
    assert metadata["parameters"] == {
        "task": "classification",
        "content_types": ["image/png"],
        "labels": 10,
    }


def test_a_text_classifiers_document_gives_its_classes() -> None:
    document = {
        "inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
        "outputs": [{"name": "top", "parameters": {"classification": 1}}],
    }
    call = parse_infer(json.dumps(document).encode(), None, max_requests=4)
    text = {"type": "text-classification/v1", "labels": CLASSES, "truncated": False}
    (tensor,) = result_outputs(call.outputs, call.shape, [text])
    assert tensor.elements == [b"0.9:7:7"]
