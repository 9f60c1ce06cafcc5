"""``conveyor gateway``: serve the Open Inference Protocol over HTTP on uvicorn.

Flags override the ``CONVEYOR_*`` variables (``GatewaySettings``); the settings are
parsed completely before anything starts. Exit status: 0 after a clean stop
(SIGTERM, Ctrl-C), 2 bad settings, 4 it could not start (Kafka unreachable, the port
taken), 5 the gateway extra is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import ssl
import sys
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from common.install import install_hint

if TYPE_CHECKING:  # the gateway extra may not be installed
    from producers.gateway.settings import GatewaySettings

EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 4
EXIT_NOT_INSTALLED = 5
_FLAGS = {
    # flag dest: settings field
    "host": "gateway_host",
    "port": "gateway_port",
    "wait_s": "gateway_wait_s",
    "kafka_bootstrap": "kafka_bootstrap",
    "redis_url": "redis_url",
}


def add_gateway_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: argparse.ArgumentParser,
) -> None:
    """Add ``gateway`` to ``commands``; ``connection`` holds the connection options."""
    gateway = commands.add_parser(
        "gateway",
        parents=[connection],
        help="serve models over HTTP: the Open Inference Protocol (KServe v2, Triton) "
        "and OpenAI's API for generation models",
        description="A stateless HTTP server in front of the queue: each infer call is "
        "sent to the model's request topic and answered from its result in Redis "
        "(docs/http.md). Run as many as you like behind a load balancer. Every setting is "
        "also a CONVEYOR_GATEWAY_* variable (the token, TLS files, limits).",
    )
    gateway.add_argument("--host", help="address to listen on [default 127.0.0.1]")
    gateway.add_argument("--port", type=int, help="port to listen on [default 8000]")
    gateway.add_argument(
        "--max-lag",
        help="answer 429 above this many requests waiting for the model's workers "
        "('none': no limit) [default 10000]",
    )
    gateway.add_argument("--wait-s", type=float, help="wait when a caller gives no timeout")
    gateway.add_argument(
        "--access-log", action="store_true", help="log every request (uvicorn's access log)"
    )
    gateway.set_defaults(handler=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    """Parse the settings, then serve until stopped."""
    given: dict[str, Any] = {
        field: getattr(args, dest)
        for dest, field in _FLAGS.items()
        if getattr(args, dest, None) is not None
    }
    if args.max_lag is not None:
        given["gateway_max_lag"] = None if args.max_lag == "none" else args.max_lag
    try:
        import uvicorn

        from producers.gateway.http import build_app
        from producers.gateway.settings import GatewaySettings
    except ImportError as exc:
        print(
            f"conveyor gateway: needs the gateway extra ({exc}): {install_hint('gateway')}",
            file=sys.stderr,
        )
        return EXIT_NOT_INSTALLED
    try:
        settings = GatewaySettings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        print(f"conveyor gateway: {problems}", file=sys.stderr)
        return EXIT_BAD_INPUT
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the gateway's errors say it
    config = uvicorn.Config(
        build_app(settings),
        host=settings.gateway_host,
        port=settings.gateway_port,
        access_log=args.access_log,
        timeout_keep_alive=settings.gateway_keep_alive_s,
        lifespan="on",
        log_level="info",
        **_tls(settings),
    )
    server = uvicorn.Server(config)
    # uvicorn exits (SystemExit) when the lifespan's start-up failed: said below instead.
    with contextlib.suppress(SystemExit):
        server.run()
    if not server.started:  # the lifespan failed (uvicorn logged why) or the port is taken
        print(
            f"conveyor gateway: did not start: Kafka at {settings.kafka_bootstrap} cannot be "
            f"reached, or {settings.gateway_host}:{settings.gateway_port} is taken (see above)",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    return 0


def _tls(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn's TLS options: HTTPS with a certificate, and client certificates (mTLS)."""
    if settings.gateway_tls_cert_file is None:
        return {}
    options: dict[str, Any] = {
        "ssl_certfile": str(settings.gateway_tls_cert_file),
        "ssl_keyfile": str(settings.gateway_tls_key_file),
    }
    if settings.gateway_tls_ca_file is not None:
        options["ssl_ca_certs"] = str(settings.gateway_tls_ca_file)
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options
