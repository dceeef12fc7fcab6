"""`run_gateway`: serve the job API until SIGINT or SIGTERM (the entry point `lorafleet gateway` calls)."""

from __future__ import annotations

import gc
import os

import structlog
from aiohttp import web

from gateway.app import create_app
from shared.config import GatewayConfig

# On SIGTERM/SIGINT the listener closes at once; requests in flight get this long to finish. A
# long-poll still waiting after that is cut, and its client polls again (another gateway, or this
# one restarted).
SHUTDOWN_GRACE_S = 10.0
# Allocations (less frees) of container objects between two young-generation collections; Python's
# default is 700. A request's short-lived objects (its task, coroutines, futures, dicts) are freed by
# reference counting, but the requests in flight hold ~3,000 of them at concurrency 64: at 700 a young
# collection ran every ~100 submits, traversed them and moved them to older generations, whose
# collections followed (a full one traverses the whole start-up heap: docs/benchmarks.md). At 10,000 the
# collector runs when cyclic garbage builds up, not for every hundred requests.
GC_YOUNG_THRESHOLD = 10_000

log = structlog.get_logger(__name__)


def run_gateway(config: GatewayConfig) -> None:
    """Serve on config.host:config.port; blocks until SIGINT/SIGTERM, then shuts down gracefully.

    Logging is the caller's to configure (shared.log.configure_logging). A client that disconnects
    cancels its handler, so an abandoned long-poll releases its Redis connection at once.
    """
    # a turn's short prompts are encoded in one call on the event loop (gateway/tokenization.py), which the
    # tokenizers library would spread over a thread per core: a gateway process is meant to use one core
    # (it scales out by processes). An operator's own setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log.info("gateway_starting", host=config.host, port=config.port)
    app = create_app(config)
    _tune_gc()
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        handle_signals=True,
        handler_cancellation=True,
        access_log=None,  # request_middleware logs one structured line per request
        print=None,
    )
    log.info("gateway_stopped")


def _tune_gc() -> None:
    """Leave what start-up built (modules, the app) out of every later collection (it lives as long as
    the process), and collect the young generation less often (GC_YOUNG_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
