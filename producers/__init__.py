"""Conveyor's client SDK: submit requests to a model and wait for their results.

    from producers import Client

    with Client(bootstrap="127.0.0.1:9092", redis_url="redis://127.0.0.1:6379/0") as client:
        request_id = client.submit(Path("digit.png"), model="digits")
        print(client.wait(request_id, timeout=10).outputs)

``AsyncClient`` has the same methods for asyncio code. This package needs no
torch: a client-only install (``pip install conveyor-serve``) can use it.
"""

from producers.client import AsyncClient, Client
from producers.errors import (
    ClientError,
    ConnectionsBusy,
    InvalidInput,
    RecordTooLarge,
    ResultTimeout,
    ServiceUnavailable,
    UnknownModel,
)
from producers.payload import sniff_content_type
from producers.results import RequestStatus
from producers.settings import ClientOptions, ClientSettings
from schemas import ContentType, ContractError, Result, Status

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "ClientOptions",
    "ClientSettings",
    "ConnectionsBusy",
    "ContentType",
    "ContractError",
    "InvalidInput",
    "RecordTooLarge",
    "RequestStatus",
    "Result",
    "ResultTimeout",
    "ServiceUnavailable",
    "Status",
    "UnknownModel",
    "sniff_content_type",
]
