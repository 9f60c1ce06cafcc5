"""``conveyor gateway`` against a real digits worker, broker and Redis, called by clients
no one here wrote: tritonclient's HTTP client (binary tensor data, the classification
extension, metadata, readiness), and plain HTTP from the standard library for what
tritonclient hides (status codes, headers, error bodies)."""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from producers import AsyncClient, ClientSettings
from producers.admin import create_model_topics
from producers.testing import Fleet, read_topic, until
from producers.testing.gateway import GatewayProcess
from schemas import topics_for

# One test process runs the module: its worker and gateway start once under pytest -n.
pytestmark = pytest.mark.xdist_group("gateway")

TOKEN = "gateway-test-token"  # a test credential, not a secret
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_LAG = 3


@pytest.fixture(scope="module")
def gateway(
    kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """One gateway for the module: a token, and back-pressure above a lag of 3."""
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
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


class Triton:
    """tritonclient's HTTP client on a thread of its own: its gevent loop cannot move
    between threads, and the tests' event loop must not block on it."""

    def __init__(self, url: str) -> None:
        self._thread = ThreadPoolExecutor(1)
        self._client = self._thread.submit(
            lambda: triton.InferenceServerClient(url, network_timeout=60)
        ).result()

    async def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # A copy each time: tritonclient's infer adds its own headers to the dict it is given.
        headers = dict(AUTH)
        call = functools.partial(getattr(self._client, method), *args, headers=headers, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    def close(self) -> None:
        self._thread.submit(self._client.close).result()
        self._thread.shutdown()


@pytest.fixture
def triton_client(gateway: GatewayProcess) -> Iterator[Triton]:
    client = Triton(gateway.url)
    yield client
    client.close()


def _post(
    gateway: GatewayProcess,
    path: str,
    document: dict[str, Any] | bytes,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, JSON body) of one POST, errors included."""
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    request = urllib.request.Request(
        f"http://{gateway.url}{path}",
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    return _open(request)


def _get(gateway: GatewayProcess, path: str, headers: dict[str, str] | None = None) -> Any:
    return _open(urllib.request.Request(f"http://{gateway.url}{path}", headers=headers or {}))


def _open(request: urllib.request.Request) -> tuple[int, dict[str, str], dict[str, Any]]:
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _digit_inputs(pngs: list[bytes]) -> list[triton.InferInput]:
    tensor = triton.InferInput("INPUT", [len(pngs)], "BYTES")
    tensor.set_data_from_numpy(np.array(pngs, dtype=np.object_))
    return [tensor]


async def _until_described(client: Triton, model: str) -> None:
    async def ready() -> bool:
        return bool(await client("is_model_ready", model))

    await until(ready, f"the gateway calls {model} ready", 120)


async def test_tritonclient_infers_as_the_sdk_answers(
    served_model: str,
    digits: list[tuple[bytes, int]],
    triton_client: Triton,
    client_settings: ClientSettings,
) -> None:
    """tritonclient reads the model's metadata and infers three digits in one call (its
    binary tensor data, both ways); each answer is the SDK's for the same image, and the
    classification extension's classes are its top classes."""
    await _until_described(triton_client, served_model)
    metadata = await triton_client("get_model_metadata", served_model)
    assert metadata["name"] == served_model
    assert metadata["versions"] == ["digits-cnn-v1"]
    assert metadata["parameters"]["task"] == "classification"
    assert metadata["parameters"]["labels"] == 10
    assert "image/png" in metadata["parameters"]["content_types"]

    pngs = [png for png, _digit in digits[:3]]
    outputs = [
        triton.InferRequestedOutput("OUTPUT"),
        triton.InferRequestedOutput("CLASSES", class_count=2),
    ]
    answer = await triton_client("infer", served_model, _digit_inputs(pngs), outputs=outputs)
    assert answer.get_response()["model_version"] == "digits-cnn-v1"
    served = [json.loads(element) for element in answer.as_numpy("OUTPUT")]
    classes = answer.as_numpy("CLASSES")
    assert classes.shape == (3, 2)

    async with AsyncClient(client_settings) as sdk:
        # The classification extension's K is the requests' top_k.
        params = {"top_k": 2}
        ids = [await sdk.submit(png, model=served_model, params=params) for png in pngs]
        expected = [(await sdk.wait(i, timeout=60)).outputs for i in ids]
    for got, want, top in zip(served, expected, classes, strict=True):
        assert [c["label"] for c in got] == [c["label"] for c in want]
        assert [c["score"] for c in got] == pytest.approx([c["score"] for c in want], abs=1e-5)
        score, index, label = top[0].decode().split(":")
        assert (int(index), label) == (want[0]["index"], want[0]["label"])
        assert float(score) == pytest.approx(want[0]["score"], abs=1e-5)


async def test_a_retry_with_the_same_id_is_computed_once(
    served_model: str,
    digits: list[tuple[bytes, int]],
    triton_client: Triton,
    gateway: GatewayProcess,
    kafka_bootstrap: str,
    uid: str,
) -> None:
    """Three calls with one id at once and one after: one answer, one request sent."""
    await _until_described(triton_client, served_model)
    request_id = f"retry-{uid}"
    png = digits[0][0]

    def call() -> list[Any]:
        client = triton.InferenceServerClient(gateway.url, network_timeout=60)
        try:
            answer = client.infer(
                served_model, _digit_inputs([png]), request_id=request_id, headers=dict(AUTH)
            )
            return [json.loads(answer.as_numpy("OUTPUT")[0]), answer.get_response()["id"]]
        finally:
            client.close()

    concurrent = await asyncio.gather(*(asyncio.to_thread(call) for _ in range(3)))
    later = await asyncio.to_thread(call)
    assert all(answer == later for answer in concurrent)
    assert later[1] == request_id

    topic = topics_for(served_model).requests
    records = await read_topic(kafka_bootstrap, topic, expect=1, timeout_s=10)
    assert [r for r in records if r.key == request_id.encode()] != []
    assert len([r for r in records if r.key == request_id.encode()]) == 1


async def test_back_pressure_refuses_with_429(
    gateway: GatewayProcess,
    client_settings: ClientSettings,
    model_name: str,
    drop_topics: list[str],
    digits: list[tuple[bytes, int]],
) -> None:
    """A model with no worker and a backlog above the limit: 429 with Retry-After, and
    nothing more is queued."""
    drop_topics.append(model_name)
    await create_model_topics(client_settings, model_name, partitions=1)
    png = digits[0][0]
    async with AsyncClient(client_settings) as sdk:
        await sdk.submit_many([png] * (MAX_LAG + 1), model=model_name)
    document = {"inputs": [{"name": "INPUT", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]}
    status, headers, body = _post(gateway, f"/v2/models/{model_name}/infer", document, AUTH)
    assert status == 429, body
    assert body["code"] == "overloaded"
    assert int(headers["retry-after"]) >= 1


async def test_a_wait_that_times_out_names_the_id_and_continues_the_trace(
    gateway: GatewayProcess,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    model_name: str,
    drop_topics: list[str],
    digits: list[tuple[bytes, int]],
    uid: str,
) -> None:
    """No worker: the caller's timeout (microseconds, as the protocol says) ends the wait
    with 504 naming the id and where to read it; the request went out with the caller's
    deadline and trace."""
    drop_topics.append(model_name)
    await create_model_topics(client_settings, model_name, partitions=1)
    request_id = f"late-{uid}"
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    tensor = triton.InferInput("INPUT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([digits[0][0]], dtype=np.object_))
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor], request_id=request_id, timeout=500_000
    )
    headers = {
        **AUTH,
        "traceparent": traceparent,
        "Inference-Header-Content-Length": str(header_length),
    }
    status, _, answer = _post(gateway, f"/v2/models/{model_name}/infer", body, headers)
    assert status == 504, answer
    assert answer["code"] == "timeout"
    assert answer["id"] == request_id
    assert answer["result"] == f"/v2/results/{request_id}"
    status, _, later = _get(gateway, answer["result"], AUTH)
    assert (status, later["state"]) == (202, "queued")

    records = await read_topic(kafka_bootstrap, topics_for(model_name).requests, 1, 10)
    (record,) = records
    sent = dict(record.headers)
    assert sent["ce_id"] == request_id.encode()
    assert "ce_deadline" in sent
    assert sent["traceparent"].decode().split("-")[1] == trace_id


async def test_bad_input_gets_the_protocols_error(
    served_model: str,
    gateway: GatewayProcess,
    triton_client: Triton,
) -> None:
    """Malformed bodies, a payload the model cannot take and an unknown model get 400 or
    404 with Conveyor's code in the body; tritonclient sees the same status."""
    path = f"/v2/models/{served_model}/infer"
    status, _, body = _post(gateway, path, b"{not json", AUTH)
    assert (status, body["code"]) == (400, "bad_request")
    two = {"inputs": [{"name": "A", "datatype": "BYTES", "shape": [2], "data": ["x"]}]}
    status, _, body = _post(gateway, path, two, AUTH)
    assert (status, body["code"]) == (400, "bad_request")
    assert "shape [2] but 1 elements" in body["error"]
    text = {"inputs": [{"name": "A", "datatype": "BYTES", "shape": [1], "data": ["seven"]}]}
    status, _, body = _post(gateway, path, text, AUTH)
    assert (status, body["code"]) == (400, "unsupported_media_type"), body

    with pytest.raises(InferenceServerException) as refused:
        await triton_client("infer", served_model, _digit_inputs([b"not an image"]))
    assert refused.value.status() == "400"
    status, _, body = _post(gateway, "/v2/models/no-such-model/infer", text, AUTH)
    assert (status, body["code"]) == (404, "unknown_model")


def test_a_missing_token_is_refused(gateway: GatewayProcess, served_model: str) -> None:
    """Without the bearer token: 401 (the health probes need none)."""
    status, headers, body = _get(gateway, f"/v2/models/{served_model}")
    assert (status, body["code"]) == (401, "unauthorized")
    assert headers["www-authenticate"] == "Bearer"
    status, _, body = _get(gateway, f"/v2/models/{served_model}", {"Authorization": "Bearer no"})
    assert status == 401
    status, _, body = _get(gateway, "/v2/health/live")
    assert (status, body) == (200, {"live": True})


def test_metrics_count_requests_by_route(gateway: GatewayProcess) -> None:
    """``/metrics`` counts requests by route template and status."""
    _get(gateway, "/v2/health/live")
    request = urllib.request.Request(f"http://{gateway.url}/metrics", headers=AUTH)
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    assert 'conveyor_gateway_requests_total{route="/v2/health/live",status="200"}' in text


def _certificates(folder: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""

    def run(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, cwd=folder)

    run(
        *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
        *("-subj", "/CN=gateway test CA", "-keyout", "ca.key", "-out", "ca.pem"),
    )
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run(
            *("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}"),
            *("-keyout", f"{name}.key", "-out", f"{name}.csr"),
        )
        run(
            *("openssl", "x509", "-req", "-days", "1", "-in", f"{name}.csr", "-CA", "ca.pem"),
            *("-CAkey", "ca.key", "-CAcreateserial", "-extfile", "san.ext"),
            *("-out", f"{name}.pem"),
        )
    return folder


async def test_mtls_refuses_a_caller_without_a_client_certificate(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """With a CA for client certificates, a caller that presents one signed by it is
    answered over HTTPS; one that presents none is refused in the handshake."""
    tls = _certificates(tmp_path)
    env = {
        "CONVEYOR_GATEWAY_TLS_CERT_FILE": str(tls / "server.pem"),
        "CONVEYOR_GATEWAY_TLS_KEY_FILE": str(tls / "server.key"),
        "CONVEYOR_GATEWAY_TLS_CA_FILE": str(tls / "ca.pem"),
    }
    with GatewayProcess(kafka_bootstrap, redis_url, tmp_path / "gateway.log", env=env) as gateway:
        url = f"https://{gateway.url}/v2/health/live"
        trusted = ssl.create_default_context(cafile=tls / "ca.pem")
        with_certificate = ssl.create_default_context(cafile=tls / "ca.pem")
        with_certificate.load_cert_chain(tls / "client.pem", tls / "client.key")

        def answered() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=10, context=with_certificate) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, ConnectionError):
                return False

        await until(
            lambda: asyncio.to_thread(answered), "the gateway answers HTTPS", 60, gateway.log
        )
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            await asyncio.to_thread(urllib.request.urlopen, url, timeout=10, context=trusted)


async def test_a_call_that_failed_to_send_leaves_its_id_free(
    served_model: str,
    gateway: GatewayProcess,
    triton_client: Triton,
    digits: list[tuple[bytes, int]],
    uid: str,
) -> None:
    """A call refused after its id was claimed (no such model) gives the claim back: the
    same id then sends and is answered."""
    await _until_described(triton_client, served_model)
    request_id = f"free-{uid}"
    tensor = triton.InferInput("INPUT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([digits[0][0]], dtype=np.object_))
    body, length = triton.InferenceServerClient.generate_request_body(
        [tensor], [triton.InferRequestedOutput("OUTPUT", binary_data=False)], request_id
    )
    headers = {**AUTH, "Inference-Header-Content-Length": str(length)}
    status, _, answer = _post(gateway, "/v2/models/nosuchmodel/infer", body, headers)
    assert (status, answer["code"]) == (404, "unknown_model")
    status, _, answer = _post(gateway, f"/v2/models/{served_model}/infer", body, headers)
    assert status == 200, answer
    assert answer["id"] == request_id


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_tritonclient_classifies_text_as_the_sdk_answers(
    gateway: GatewayProcess,
    triton_client: Triton,
    workers: Fleet,
    text_models: dict[str, Path],
    client_settings: ClientSettings,
    model_name: str,
    drop_topics: list[str],
) -> None:
    """A text classifier (``hf:PATH``, a tiny model): tritonclient reads its metadata and
    sends two texts as binary BYTES (no media type: UTF-8 that is no image is text); the
    answers are the SDK's for the same texts."""
    drop_topics.append(model_name)
    await create_model_topics(client_settings, model_name, partitions=1)
    worker = workers.start(model=f"hf:{text_models['text-classification']}")
    await worker.until_ready(240)
    await _until_described(triton_client, model_name)
    metadata = await triton_client("get_model_metadata", model_name)
    assert metadata["parameters"]["task"] == "classification"
    assert metadata["parameters"]["content_types"] == ["text/plain", "application/json"]

    texts = ["Return a JSON string.", "paths"]
    tensor = triton.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    outputs = [
        triton.InferRequestedOutput("OUTPUT"),
        triton.InferRequestedOutput("CLASSES", class_count=2),
    ]
    answer = await triton_client("infer", model_name, [tensor], outputs=outputs)
    served = [json.loads(element) for element in answer.as_numpy("OUTPUT")]
    classes = answer.as_numpy("CLASSES")

    async with AsyncClient(client_settings) as sdk:
        ids = [
            await sdk.submit(
                t.encode(), model=model_name, content_type="text/plain", params={"top_k": 2}
            )
            for t in texts
        ]
        expected = [(await sdk.wait(i, timeout=60)).outputs for i in ids]
    for got, want, top in zip(served, expected, classes, strict=True):
        assert [c["label"] for c in got["labels"]] == [c["label"] for c in want["labels"]]
        scores = [c["score"] for c in want["labels"]]
        assert [c["score"] for c in got["labels"]] == pytest.approx(scores, abs=1e-4)
        assert top[0].decode().split(":")[2] == want["labels"][0]["label"]
