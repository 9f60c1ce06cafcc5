"""torchvision's published weights, downloaded by a real one-command host when asked
(``--weights DEFAULT``), against the real broker and Redis.

torchvision hard-codes its weights' URLs (download.pytorch.org, out of reach here), so
the host serves ``tests.weights_server:MobileNetPublishedHere``: the worker's own loader
of ``torchvision:mobilenet_v3_small``, with the one change that ``IMAGENET1K_V1``'s URL
is a local server's (``tests.weights_server``), which publishes a state_dict the test
saved, under torch hub's hash-prefixed file name. The download, its progress bar, its
check and torch hub's cache (``$TORCH_HOME``, a folder of the test's) are torchvision's
and torch's own. Two processes, one download: the supervisor starts the second once
the first has loaded, and it reads the cache. The server is stopped before any request,
and the answers are those of the published weights.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, requests, wait_for_results
from schemas import ContentType, Status, topics_for
from tests.served_direct import calibrate, photo_like, pil, sharpen
from tests.weights_server import URL_VARIABLE, WeightsServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ARCH = "mobilenet_v3_small"
IMAGES = 48
SCORE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def published() -> tuple[bytes, torch.nn.Module]:
    """The state_dict file the server publishes, and the model it holds (batch norms
    measured on photos and the head drawn larger, so that scores spread out)."""
    torch.manual_seed(6)
    module = torchvision.models.get_model(ARCH, weights=None)
    transform = torchvision.models.get_model_weights(ARCH).DEFAULT.transforms()
    batch = torch.stack([transform(pil(photo_like(seed))) for seed in range(32)])
    calibrate(module, lambda: module(batch))
    sharpen(module.classifier[-1], 0.5)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getvalue(), module.eval()


@pytest.mark.timeout(480)
async def test_a_host_downloads_torchvisions_published_weights_once_and_serves_them(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    published: tuple[bytes, torch.nn.Module],
    tmp_path: Path,
) -> None:
    data, module = published
    name = f"{ARCH}-{hashlib.sha256(data).hexdigest()[:8]}.pth"  # torch hub's form
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=2)
    with WeightsServer() as server:
        env = {URL_VARIABLE: server.add(name, data), "TORCH_HOME": str(tmp_path / "torch")}
        host = workers.start(
            *("--processes", "2", "--weights", "DEFAULT", "--max-batch-size", "16"),
            model="tests.weights_server:MobileNetPublishedHere",
            env=env,
        )
        await host.until_ready(360)  # both processes loaded, warmed up and consuming
        assert len(host.children()) == 2
        assert server.downloads() == [f"/{name}"], workers.logs()[-3000:]  # once, for both
    assert (tmp_path / "torch" / "hub" / "checkpoints" / name).read_bytes() == data
    assert "100%" in workers.logs()  # torch hub's progress bar, finished

    pngs = [photo_like(seed) for seed in range(IMAGES)]
    records, ids = requests(pngs, IMAGES, model_name, ContentType.PNG)
    await produce(kafka_bootstrap, topics.requests, records)
    results = await wait_for_results(redis_url, ids, timeout_s=180)

    assert set(results) == set(ids), workers.logs()[-3000:]
    weights = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
    transform, labels = weights.transforms(), weights.meta["categories"]
    with torch.inference_mode():
        for request_id, png in zip(ids, pngs, strict=True):
            result = results[request_id]
            assert result.status is Status.ok, result
            assert result.model_version == f"{ARCH}:IMAGENET1K_V1"
            scores, indices = module(transform(pil(png))[None]).softmax(dim=1).topk(5)
            outputs = result.outputs
            assert isinstance(outputs, list)
            assert [o["index"] for o in outputs] == indices[0].tolist()
            assert [o["label"] for o in outputs] == [labels[i] for i in indices[0].tolist()]
            served = np.array([o["score"] for o in outputs])
            assert np.abs(served - scores[0].numpy()).max() <= SCORE_TOLERANCE
