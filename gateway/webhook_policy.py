"""Which webhook URLs a job may name: checked at submit, so a refused URL is a 400 and never queued.

A URL must be absolute, https (http only where the gateway allows it), carry no credentials, and
name a host on the allow-list: an exact name, or a `*.example.com` entry for its subdomains. Hosts
are compared as written (lower-cased), never resolved: the operator lists the names callers may use.
"""

from __future__ import annotations

from yarl import URL

from gateway.errors import RequestError
from shared.config import WebhookConfig
from shared.errors import ErrorCode

MAX_URL_CHARS = 2048
_PARAM = "webhook"


def _host_allowed(host: str, allow_hosts: tuple[str, ...]) -> bool:
    for entry in allow_hosts:
        entry = entry.lower()
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and len(host) > len(entry) - 1:
                return True
        elif host == entry:
            return True
    return False


def check_webhook_url(text: object, config: WebhookConfig) -> str:
    """`text` as a webhook URL this gateway may call; RequestError (naming `webhook`) otherwise."""
    if not isinstance(text, str) or not text or len(text) > MAX_URL_CHARS:
        raise RequestError(
            ErrorCode.INVALID_REQUEST, f"webhook must be a URL of at most {MAX_URL_CHARS} characters", param=_PARAM
        )
    if not config.enabled:
        raise RequestError(ErrorCode.WEBHOOK_NOT_ALLOWED, "webhooks are not enabled on this gateway", param=_PARAM)
    try:
        url = URL(text)
    except ValueError:
        url = None
    if url is None or not url.is_absolute() or not url.host or url.scheme not in ("http", "https"):
        raise RequestError(ErrorCode.INVALID_REQUEST, "webhook must be an absolute http(s) URL", param=_PARAM)
    if url.scheme == "http" and not config.allow_http:
        raise RequestError(ErrorCode.WEBHOOK_NOT_ALLOWED, "webhook URLs must use https", param=_PARAM)
    if url.user is not None or url.password is not None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "webhook URLs must not carry credentials", param=_PARAM)
    if not _host_allowed(url.host.lower(), config.allow_hosts):
        message = f"webhook host {url.host!r} is not on this gateway's allow-list"
        raise RequestError(ErrorCode.WEBHOOK_NOT_ALLOWED, message, param=_PARAM)
    return str(url)
