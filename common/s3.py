"""S3-compatible object stores: connection settings and a client, for the SDK and the worker.

Payloads stored by reference (``ce_dataref: s3://bucket/key``) are written by
the SDK and read by workers through the same settings (``CONVEYOR_S3_*``).
The client is aiobotocore's, in the optional ``s3`` extra
(``pip install 'conveyor-serve[s3]'``): it signs requests (SigV4), follows botocore's
credential chain when no key is given here (``AWS_*`` variables, ``~/.aws``,
instance and pod roles such as EKS's IRSA), and speaks to AWS S3 and to
S3-compatible stores (SeaweedFS, Ceph, ...) alike. Nothing imports it unless
an S3 reference is used, so a client-only install stays small.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, SecretStr, model_validator

from common.install import install_hint

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

__all__ = ["S3Settings", "S3Unavailable", "s3_client", "s3_fault"]

Fault = Literal["missing", "denied", "outage"]


class S3Unavailable(RuntimeError):
    """S3 references are used but aiobotocore (the ``s3`` extra) is not installed.

    The SDK raises it to its callers as a ``ClientError``; the worker as a ``ConfigError``.
    """


class S3Settings(BaseModel):
    """Where the S3-compatible store is and how to sign in (a base of the settings classes)."""

    model_config = ConfigDict(use_attribute_docstrings=True, hide_input_in_errors=True)

    s3_endpoint_url: str | None = None
    """URL of an S3-compatible store, e.g. ``http://127.0.0.1:8333``; default AWS S3."""
    s3_region: str = "us-east-1"
    """Region the requests are signed for."""
    s3_access_key_id: str | None = None
    """Access key; default botocore's chain (AWS_* variables, ~/.aws, instance or pod role)."""
    s3_secret_access_key: SecretStr | None = None
    """Secret key of ``s3_access_key_id``."""
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """``path`` (http://host/bucket/key) suits most S3-compatible stores; AWS takes both."""

    @model_validator(mode="after")
    def _check_keys(self) -> S3Settings:
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("s3_access_key_id and s3_secret_access_key go together: give both")
        return self


@asynccontextmanager
async def s3_client(settings: S3Settings, max_connections: int = 16) -> AsyncIterator[S3Client]:
    """An S3 client for ``settings``, closed on exit; raises ``S3Unavailable`` without
    aiobotocore."""
    try:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session
    except ImportError as exc:
        raise S3Unavailable(
            f"S3 references need aiobotocore: {install_hint('s3')} ({exc})"
        ) from None
    keys: dict[str, Any] = {}
    if settings.s3_access_key_id is not None and settings.s3_secret_access_key is not None:
        keys = {
            "aws_access_key_id": settings.s3_access_key_id,
            "aws_secret_access_key": settings.s3_secret_access_key.get_secret_value(),
        }
    config = AioConfig(
        max_pool_connections=max_connections,
        connect_timeout=5,
        read_timeout=30,
        # Retries are the caller's (outages are retried with backoff, forever, by the
        # worker): botocore's own would only stretch each attempt.
        retries={"max_attempts": 1},
        s3={"addressing_style": settings.s3_addressing_style},
    )
    session = get_session()
    async with session.create_client(
        "s3",
        region_name=settings.s3_region,
        endpoint_url=settings.s3_endpoint_url,
        config=config,
        **keys,
    ) as client:
        yield client


def s3_fault(exc: BaseException) -> Fault | None:
    """What an exception from the S3 client means for the object asked for.

    ``missing``: no such key or bucket; ``denied``: access refused or a request the
    store calls bad (retrying does not help); ``outage``: the store is unreachable,
    slow or failing (retry later). None for an exception that is not the client's.
    """
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return None
    if isinstance(exc, ClientError):
        response: Any = exc.response
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        code = str(response.get("Error", {}).get("Code", ""))
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound", "404"):
            return "missing"
        if status in (408, 429) or status >= 500 or code in ("SlowDown", "RequestTimeout"):
            return "outage"
        return "denied"
    if isinstance(exc, BotoCoreError | OSError | TimeoutError):
        return "outage"
    return None
