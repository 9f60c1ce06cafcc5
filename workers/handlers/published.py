"""Published weights: read from the download caches, downloaded into them when asked.

Architectures served by name have published weights. torchvision's weights enums
point at files that torch hub downloads into ``$TORCH_HOME/hub/checkpoints/``; timm's
pretrained tags point at Hugging Face Hub repositories, which ``huggingface_hub``
downloads into ``$HF_HOME/hub/`` (a few tags at URLs that go through torch hub too).

Nothing is downloaded unless the weights are asked for by name (``weights="DEFAULT"``,
or a torchvision weights name such as ``IMAGENET1K_V2``). Without a name, the published
weights are read from the cache when a download, or a copy by hand, put them there.
A download shows a progress bar on stderr and is checked against a checksum before it
is used: torch hub's hash prefix in the file's name, or the SHA-256 the Hugging Face
Hub names an uploaded file by; a file that does not match is not kept. Failures are
``ModelLoadError``s naming the address and, offline, what to fetch by hand and where
to put it.

The caches are shared by the processes of a host: the supervisor starts one worker
process first, and the others find what its download put there.
"""

from __future__ import annotations

import logging
import re
import urllib.error
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import torch

from workers.handlers.weights import ModelLoadError, sha256

log = logging.getLogger(__name__)

DEFAULT_WEIGHTS = "DEFAULT"
"""``weights="DEFAULT"``: the published weights, downloaded unless already cached."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_HAND_COPY = "Where this machine has no network, download that file on one that has and {where}"

T = TypeVar("T")


def hub_file(url: str) -> Path:
    """Where torch hub keeps its download of ``url``."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name


def torch_hub_cached(spec: str, url: str) -> Path:
    """The published weights at ``url`` from torch hub's cache; never downloads."""
    file = hub_file(url)
    if not file.is_file():
        raise ModelLoadError(
            f"{spec}: no weights given and {file} is not in torch hub's cache, and nothing "
            f"is downloaded unless asked. Pass weights='DEFAULT' to download it from {url}, "
            "copy that file there, pass weights=PATH (a state_dict saved with torch.save), "
            "or weights='random' for a benchmark whose outputs mean nothing"
        )
    return file


def torch_hub_download(spec: str, url: str, download: Callable[[], T]) -> T:
    """What ``download`` returns: torch hub's download of ``url`` into its cache with a
    progress bar and its hash prefix checked (or, when it is cached, the file as it is,
    with no network), its failures as ``ModelLoadError``."""
    file = hub_file(url)
    try:
        return download()
    except urllib.error.URLError as exc:  # HTTPError too: the server answered, but no file
        reason = exc if isinstance(exc, urllib.error.HTTPError) else exc.reason
        where = _HAND_COPY.format(where=f"copy it to {file}")
        raise ModelLoadError(f"{spec}: cannot download {url} ({reason}). {where}") from exc
    except OSError as exc:  # a connection reset or timed out, or the cache not writable
        raise ModelLoadError(f"{spec}: cannot download {url} to {file}: {exc}") from exc
    except RuntimeError as exc:
        if "invalid hash value" not in str(exc):
            raise _unreadable(spec, file, exc) from exc
        raise ModelLoadError(
            f"{spec}: the file downloaded from {url} does not match its checksum ({exc}), "
            "so it was not kept. Download it again; if it fails again, what answers at that "
            "address (a proxy?) is not serving the published file"
        ) from exc
    except Exception as exc:
        raise _unreadable(spec, file, exc) from exc


def torch_hub_fetch(url: str) -> Path:
    """The file at ``url`` in torch hub's cache, downloaded there first if it is not, with
    a progress bar and checked against the hash prefix its name carries (as
    ``torch.hub.load_state_dict_from_url`` does, without loading it)."""
    file = hub_file(url)
    if not file.is_file():
        match = torch.hub.HASH_REGEX.search(file.name)
        file.parent.mkdir(parents=True, exist_ok=True)
        log.info("downloading %s to %s", url, file)
        torch.hub.download_url_to_file(
            url, str(file), match.group(1) if match else None, progress=True
        )
    return file


def _unreadable(spec: str, file: Path, exc: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"{spec}: cannot read the published weights in {file}: {exc}. Delete that file to "
        "download it again"
    )


def hf_cached(repo: str, filenames: Sequence[str]) -> Path | None:
    """The first of ``filenames`` that the Hugging Face cache holds for ``repo``
    (``owner/name``, ``@revision`` optional); never downloads."""
    from huggingface_hub import try_to_load_from_cache

    repo_id, _, revision = repo.partition("@")
    for filename in filenames:
        found = try_to_load_from_cache(repo_id, filename, revision=revision or None)
        if isinstance(found, str):
            return Path(found)
    return None


def hf_download(spec: str, repo: str, filenames: Sequence[str]) -> Path:
    """The first of ``filenames`` that ``repo`` holds, from the Hugging Face cache, or
    downloaded into it (with a progress bar) and checked against the SHA-256 the Hub names
    it by; a download that does not match is deleted."""
    from huggingface_hub import hf_hub_download, hf_hub_url
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
    )
    from tqdm import tqdm  # installed with huggingface_hub

    cached = hf_cached(repo, filenames)
    if cached is not None:
        return cached
    repo_id, _, revision = repo.partition("@")
    for filename in filenames:
        url = hf_hub_url(repo_id, filename, revision=revision or None)
        try:
            # Plain tqdm: the Hub client's own bar shows on a terminal only, and a worker's
            # stderr is mostly a log; torch hub's bar shows in both.
            path = Path(
                hf_hub_download(repo_id, filename, revision=revision or None, tqdm_class=tqdm)
            )
        except RemoteEntryNotFoundError:
            continue  # the repository holds its weights under another of the names
        except LocalEntryNotFoundError as exc:  # the Hub cannot be reached
            where = _HAND_COPY.format(where="pass weights=PATH")
            raise ModelLoadError(f"{spec}: cannot download {url} ({exc}). {where}") from exc
        except (HfHubHTTPError, OSError) as exc:
            raise ModelLoadError(f"{spec}: cannot download {url}: {exc}") from exc
        check_blob(spec, url, path)
        return path
    raise ModelLoadError(
        f"{spec}: {repo_id} on the Hugging Face Hub holds none of {', '.join(filenames)}"
    )


def check_blob(spec: str, url: str, path: Path) -> None:
    """Delete a download whose content is not the SHA-256 the cache names its blob by
    (the Hub's ETag of a file stored with Git LFS, as model weights are)."""
    blob = path.resolve()
    if not _SHA256.fullmatch(blob.name):
        log.warning("%s: %s is named by no SHA-256 (not an LFS file): not checked", spec, url)
        return
    digest = sha256(blob)
    if digest != blob.name:
        blob.unlink()
        path.unlink(missing_ok=True)
        raise ModelLoadError(
            f"{spec}: the file downloaded from {url} does not match its checksum (sha256 "
            f"{digest}, the Hub says {blob.name}), so it was not kept. Download it again; "
            "if it fails again, what answers at that address is not serving the published file"
        )
