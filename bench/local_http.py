"""HTTP to the processes a bench starts on this machine: never through a proxy the environment names
(http_proxy would send 127.0.0.1 requests away), and a readiness probe."""

from __future__ import annotations

import urllib.error
import urllib.request

LOCAL_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def answers_ok(url: str) -> bool:
    """Whether GET `url` answers 200 within a second."""
    try:
        with LOCAL_HTTP.open(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
