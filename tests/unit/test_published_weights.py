"""Published weights by name: downloaded when asked, with a progress bar and a checksum,
into the cache the next load reads; a clear error offline; never a download otherwise.

Nothing here reaches the internet: a local server (``tests.weights_server``) serves real
weights files the tests saved, and the download is pointed at it.

- torchvision: its weights enums hard-code download.pytorch.org, so the tests point the
  URL of one real entry (``MobileNet_V3_Small_Weights.IMAGENET1K_V1``) at the server;
  that URL is all that changes. The download is torchvision's ``get_state_dict``
  into torch hub's cache (``$TORCH_HOME``, a temporary folder), its progress bar and its
  hash-prefix check are torch hub's.
- timm's Hub downloads: the ``huggingface_hub`` client is pointed at the server by
  ``HF_ENDPOINT``, its documented setting for a mirror of the Hub, which it reads when
  imported; so those loads run in a Python process of their own, with ``HF_HOME`` a
  temporary folder.
- timm's tags published at a URL go through ``torch_hub_fetch``, tested on its own.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from safetensors.torch import save

from schemas import DEFAULT_LIMITS
from tests.weights_server import WeightsServer
from workers.handlers.base import ImageClassifier
from workers.handlers.published import torch_hub_download, torch_hub_fetch
from workers.model.loader import ModelLoadError, load_handler

ARCH = "mobilenet_v3_small"
ENTRY = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
TIMM_SPEC = "timm:test_vit.r160_in1k"
TIMM_REPO = "timm/test_vit.r160_in1k"


def load(spec: str, weights: str | None) -> Any:
    return load_handler(
        spec,
        device="cpu",
        weights=weights,
        dtype="float32",
        channels_last=None,
        limits=DEFAULT_LIMITS,
    )


def state_bytes(module: torch.nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getvalue()


def hub_name(data: bytes, stem: str = ARCH) -> str:
    """torch hub's file name for ``data``: the stem, '-', its SHA-256's first 8 digits."""
    return f"{stem}-{hashlib.sha256(data).hexdigest()[:8]}.pth"


@pytest.fixture(scope="module")
def published() -> tuple[bytes, torch.nn.Module]:
    """The state_dict file the server publishes, and the model it holds."""
    torch.manual_seed(3)
    module = torchvision.models.get_model(ARCH, weights=None)
    return state_bytes(module), module


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty torch hub cache; returns its checkpoints folder."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    return tmp_path / "hub" / "checkpoints"


@pytest.fixture
def server() -> Any:
    with WeightsServer() as running:
        yield running


def publish_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setattr(ENTRY.value, "url", url)


# -- torchvision ----------------------------------------------------------------------------


def test_default_weights_are_downloaded_once_with_a_progress_bar_into_the_cache(
    hub: Path,
    server: WeightsServer,
    published: tuple[bytes, torch.nn.Module],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    data, module = published
    name = hub_name(data)
    publish_at(monkeypatch, server.add(name, data))

    handler = load(f"torchvision:{ARCH}", "DEFAULT")

    assert server.downloads() == [f"/{name}"]
    assert (hub / name).read_bytes() == data
    assert "100%" in capfd.readouterr().err  # torch hub's progress bar, finished
    assert isinstance(handler, ImageClassifier)
    assert handler.version == f"{ARCH}:IMAGENET1K_V1"
    for ours, theirs in zip(
        handler.module.state_dict().values(), module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # The cache now holds them: by name or without one, no second download.
    assert load(f"torchvision:{ARCH}", "IMAGENET1K_V1").version == handler.version
    assert load(f"torchvision:{ARCH}", None).version == handler.version
    assert server.downloads() == [f"/{name}"]


def test_a_download_that_does_not_match_its_checksum_is_refused_and_not_kept(
    hub: Path,
    server: WeightsServer,
    published: tuple[bytes, torch.nn.Module],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data, _ = published
    name = f"{ARCH}-00000000.pth"  # a hash prefix the file does not have
    publish_at(monkeypatch, server.add(name, data))

    with pytest.raises(ModelLoadError) as caught:
        load(f"torchvision:{ARCH}", "DEFAULT")

    message = str(caught.value)
    assert "does not match its checksum" in message
    assert server.url in message
    assert server.downloads() == [f"/{name}"]
    assert not hub.exists() or list(hub.iterdir()) == []  # nothing kept, not even a part


def test_without_a_network_the_error_says_what_to_download_and_where_to_put_it(
    hub: Path,
    server: WeightsServer,
    published: tuple[bytes, torch.nn.Module],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data, _ = published
    name = hub_name(data)
    url = server.add(name, data)
    publish_at(monkeypatch, url)
    server.stop()

    with pytest.raises(ModelLoadError) as caught:
        load(f"torchvision:{ARCH}", "IMAGENET1K_V1")

    message = str(caught.value)
    assert f"cannot download {url}" in message
    assert "refused" in message  # the reason: nothing listens there
    assert f"copy it to {hub / name}" in message


def test_nothing_is_downloaded_unless_asked(
    hub: Path,
    server: WeightsServer,
    published: tuple[bytes, torch.nn.Module],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    data, _ = published
    publish_at(monkeypatch, server.add(hub_name(data), data))
    file = tmp_path / "mine.pt"
    file.write_bytes(data)

    with pytest.raises(ModelLoadError, match="weights='DEFAULT' to download it from"):
        load(f"torchvision:{ARCH}", None)  # nothing cached
    assert load(f"torchvision:{ARCH}", "random").version == f"{ARCH}:random-weights"
    assert load(f"torchvision:{ARCH}", str(file)).version.startswith(f"{ARCH}:sha256-")

    assert server.requests == []


def test_an_unknown_weights_name_lists_the_published_ones() -> None:
    with pytest.raises(ModelLoadError, match="DEFAULT, IMAGENET1K_V1: downloaded when named"):
        load(f"torchvision:{ARCH}", "IMAGENET1K_V9")


# -- a file at a URL through torch hub (timm's tags that are not on the Hub) ------------------


def test_torch_hub_fetch_downloads_once_and_checks_the_hash_in_the_name(
    hub: Path, server: WeightsServer, capfd: pytest.CaptureFixture[str]
) -> None:
    data = b"weights" * 1000
    good = server.add(hub_name(data, "net"), data)
    bad = server.add("other-00000000.pth", data)

    fetched = torch_hub_download("timm:net", good, lambda: torch_hub_fetch(good))
    assert fetched == hub / hub_name(data, "net")
    assert fetched.read_bytes() == data
    assert "100%" in capfd.readouterr().err
    assert torch_hub_download("timm:net", good, lambda: torch_hub_fetch(good)) == fetched
    assert len(server.downloads()) == 1

    with pytest.raises(ModelLoadError, match="does not match its checksum"):
        torch_hub_download("timm:other", bad, lambda: torch_hub_fetch(bad))
    assert sorted(hub.iterdir()) == [fetched]


# -- timm's published weights on the Hugging Face Hub, in a process of its own ---------------

# The Hub client retries a Hub it cannot reach, with backoff (1+2+4+8+8 s): each load's
# waits are recorded in "waits" rather than slept, so the error after the retries comes at once.
_LOADS = """
import json, sys
from unittest import mock
from schemas import DEFAULT_LIMITS
from workers.model.loader import ModelLoadError, load_handler
for spec, weights in json.loads(sys.argv[1]):
    waits = []
    with mock.patch("huggingface_hub.utils._http.time.sleep", waits.append):
        try:
            handler = load_handler(spec, device="cpu", weights=weights, dtype="float32",
                                   channels_last=None, limits=DEFAULT_LIMITS)
            total = sum(float(t.double().sum()) for t in handler.module.state_dict().values())
            loaded = {"version": handler.version, "sum": total}
        except ModelLoadError as exc:
            loaded = {"error": str(exc)}
    print(json.dumps({**loaded, "waits": waits}), flush=True)
"""


def load_elsewhere(
    server: WeightsServer, home: Path, *loads: tuple[str, str | None]
) -> tuple[list[dict[str, Any]], str]:
    """Each load's version and weights' sum, or its error, and the Hub client's backoff
    waits (not slept), in a new Python process whose Hugging Face client is pointed at
    ``server``; and that process's stderr."""
    env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(home)}
    env["TORCH_HOME"] = str(home / "torch")
    done = subprocess.run(
        [sys.executable, "-c", _LOADS, json.dumps(loads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines()], done.stderr


@pytest.fixture(scope="module")
def timm_weights() -> tuple[bytes, float]:
    """A safetensors file of ``TIMM_SPEC``'s model, and the sum of its tensors."""
    import timm

    torch.manual_seed(4)
    module = timm.create_model(TIMM_SPEC.partition(":")[2])
    state = module.state_dict()
    return save(state), sum(float(t.double().sum()) for t in state.values())


@pytest.mark.slow
def test_timm_default_weights_come_from_the_hub_checked_then_from_its_cache(
    server: WeightsServer, tmp_path: Path, timm_weights: tuple[bytes, float]
) -> None:
    data, total = timm_weights
    server.add_hf(TIMM_REPO, "model.safetensors", data)
    # Another repository's file, whose content is not what the Hub's ETag says.
    server.add_hf("timm/test_convnext.r160_in1k", "model.safetensors", data, etag="0" * 64)

    (corrupt, downloaded, cached), stderr = load_elsewhere(
        server,
        tmp_path,
        ("timm:test_convnext.r160_in1k", "DEFAULT"),
        (TIMM_SPEC, "DEFAULT"),
        (TIMM_SPEC, None),
    )

    assert "does not match its checksum" in corrupt["error"]
    assert list((tmp_path / "hub").rglob(f"blobs/{'0' * 64}")) == []  # not kept
    assert downloaded["version"] == "test_vit:r160_in1k"
    assert downloaded["sum"] == pytest.approx(total, rel=1e-9)
    assert cached == downloaded
    assert "model.safetensors: 100%" in stderr  # the progress bar, finished
    assert server.downloads() == [
        "/timm/test_convnext.r160_in1k/resolve/main/model.safetensors",
        f"/{TIMM_REPO}/resolve/main/model.safetensors",
    ]


@pytest.mark.slow
def test_timm_without_a_network_or_without_asking(
    server: WeightsServer, tmp_path: Path, timm_weights: tuple[bytes, float]
) -> None:
    data, _ = timm_weights
    url = server.add_hf(TIMM_REPO, "model.safetensors", data)
    file = tmp_path / "mine.safetensors"
    file.write_bytes(data)

    (none, random, own), _ = load_elsewhere(
        server, tmp_path, (TIMM_SPEC, None), (TIMM_SPEC, "random"), (TIMM_SPEC, str(file))
    )
    assert "weights='DEFAULT' to download them" in none["error"]
    assert TIMM_REPO in none["error"]
    assert random["version"] == "test_vit:random-weights"
    assert own["version"].startswith("test_vit:sha256-")
    assert server.requests == []  # not even a look at the Hub

    server.stop()
    (offline,), _ = load_elsewhere(server, tmp_path, (TIMM_SPEC, "DEFAULT"))
    assert f"cannot download {url}" in offline["error"]
    assert "pass weights=PATH" in offline["error"]
    assert offline["waits"]  # the error came after the Hub client's retries, not before
