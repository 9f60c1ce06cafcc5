"""A timm model served by a real one-command host, against the real broker and Redis.

``conveyor worker --model timm:convnext_atto.d2_in1k --weights DEFAULT --processes 2`` on
the CPU. The published weights come from a local stand-in for the Hugging Face Hub
(``tests.weights_server``), named by ``HF_ENDPOINT``, the client's setting for a mirror
of the Hub, with ``HF_HOME`` a folder of the test's own: the file is a safetensors file
of the architecture that the test saved (random weights, the head drawn at a larger
scale so that scores spread out). The supervisor starts one process first; its download
lands in the cache the second one reads, so the server sends the file once. The server
is stopped before any request: serving needs no network. Every answer equals timm's own
evaluation transform and the same weights run directly, one image at a time, within the
tolerance of tests/unit/test_served_equals_direct.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import timm
import timm.data
import torch
from safetensors.torch import save

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, requests, wait_for_results
from schemas import ContentType, Status, topics_for
from tests.served_direct import photo_like, pil, sharpen
from tests.weights_server import WeightsServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "convnext_atto.d2_in1k"
WEIGHTS_PATH = f"/timm/{NAME}/resolve/main/model.safetensors"
IMAGES = 48
SCORE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def published() -> tuple[bytes, torch.nn.Module]:
    """The weights the stand-in Hub publishes, and the model they came from."""
    torch.manual_seed(5)
    module = timm.create_model(NAME)
    sharpen(module.get_classifier(), 0.5)
    return save(module.state_dict()), module.eval()


@pytest.mark.timeout(480)
async def test_a_host_downloads_the_published_weights_once_and_answers_as_timm_does(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    published: tuple[bytes, torch.nn.Module],
    tmp_path: Path,
) -> None:
    data, module = published
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=2)
    with WeightsServer() as hub:
        hub.add_hf(f"timm/{NAME}", "model.safetensors", data)
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
        host = workers.start(
            *("--processes", "2", "--weights", "DEFAULT", "--max-batch-size", "16"),
            model=f"timm:{NAME}",
            env=env,
        )
        await host.until_ready(360)  # both processes loaded, warmed up and consuming
        assert len(host.children()) == 2
        assert hub.downloads() == [WEIGHTS_PATH], workers.logs()[-3000:]  # once, for both
    assert "model.safetensors: 100%" in workers.logs()  # the download's progress bar

    pngs = [photo_like(seed) for seed in range(IMAGES)]
    records, ids = requests(pngs, IMAGES, model_name, ContentType.PNG)
    await produce(kafka_bootstrap, topics.requests, records)
    results = await wait_for_results(redis_url, ids, timeout_s=180)

    assert set(results) == set(ids), workers.logs()[-3000:]
    config = timm.data.resolve_model_data_config(module)
    transform = timm.data.create_transform(**config, is_training=False)
    names = timm.data.ImageNetInfo()
    with torch.inference_mode():
        for request_id, png in zip(ids, pngs, strict=True):
            result = results[request_id]
            assert result.status is Status.ok, result
            assert result.model_version == "convnext_atto:d2_in1k"
            scores, indices = module(transform(pil(png))[None]).softmax(dim=1).topk(5)
            outputs = result.outputs
            assert isinstance(outputs, list)
            assert [o["index"] for o in outputs] == indices[0].tolist()
            assert [o["label"] for o in outputs] == [
                names.index_to_description(i) for i in indices[0].tolist()
            ]
            served = np.array([o["score"] for o in outputs])
            assert np.abs(served - scores[0].numpy()).max() <= SCORE_TOLERANCE
    sizes = [r.timings.batch_size for r in results.values() if r.timings]
    assert max(sizes) > 1  # served in batches
