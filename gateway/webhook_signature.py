"""Webhook signatures: HMAC-SHA256 over `<timestamp>.<body>` with the tenant's signing key.

The header reads `Lorafleet-Signature: t=<unix seconds>,v1=<hex digest>` (Stripe's layout): the
timestamp is signed with the body, so a receiver that rejects old timestamps cannot be replayed a
captured call later. Each tenant's key is derived from the gateway's webhook secret
(HMAC-SHA256(secret, "lorafleet-webhook:" + tenant)): nothing per tenant is stored, one tenant's key
says nothing about another's, and rotating the secret rotates them all. A tenant reads its key from
`GET /v1/webhooks/key`.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "Lorafleet-Signature"
DELIVERY_HEADER = "Lorafleet-Delivery"  # the same for every attempt of one delivery: receivers dedupe on it
DEFAULT_TOLERANCE_S = 300


def tenant_signing_key(secret: str, tenant_id: str) -> str:
    return hmac.new(secret.encode(), f"lorafleet-webhook:{tenant_id}".encode(), hashlib.sha256).hexdigest()


def _digest(key: str, timestamp: int, body: bytes) -> str:
    return hmac.new(key.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def signature_header(key: str, timestamp: int, body: bytes) -> str:
    return f"t={timestamp},v1={_digest(key, timestamp, body)}"


def verify_signature(
    key: str, header: str, body: bytes, *, now: float, tolerance_s: float = DEFAULT_TOLERANCE_S
) -> bool:
    """What a receiver does: the header parses, its timestamp is within `tolerance_s` of `now`, and the
    digest matches (compared in constant time)."""
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
        digest = fields["v1"]
    except (ValueError, KeyError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(digest, _digest(key, timestamp, body))
