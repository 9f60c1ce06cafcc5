"""Published weights by name: downloaded when asked, with a progress bar and a checksum,
into the cache the next load reads; a clear error offline; never a download otherwise.

Nothing here reaches the internet: a local server (``tests.weights_server``) serves real
weights files the tests saved, and the download is pointed at it.

- torchvision: its weights enums hard-code download.pytorch.org, so the tests point the
  URL of one real entry (``MobileNet_V3_Small_Weights.IMAGENET1K_V1``) at the server;
  that URL is all that changes. The download is torchvision's ``get_state_dict``
  into torch hub's cache (``$TORCH_HOME``, a temporary folder), its progress bar and its
  hash-prefix check are torch hub's.
- files at a URL fetched without loading them go through ``torch_hub_fetch``, tested on
  its own.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision

from schemas import DEFAULT_LIMITS
from tests.weights_server import WeightsServer
from workers.handlers.base import ImageClassifier
from workers.handlers.published import torch_hub_download, torch_hub_fetch
from workers.model.loader import ModelLoadError, load_handler

ARCH = "mobilenet_v3_small"
ENTRY = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1


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


# -- a file at a URL through torch hub ---------------------------------------------------------


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
