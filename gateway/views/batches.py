"""OpenAI Batch API, as the caller's tenant: create, list, read and cancel batches. The work is done
by the batch driver (gateway/batch_driver.py) of whichever gateway leases the batch."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from gateway.auth import request_tenant
from gateway.batch_lines import ENDPOINTS
from gateway.batches import BatchRecord, BatchStatus, new_batch_id
from gateway.errors import RequestError
from gateway.files import FilePurpose
from gateway.json_body import parse_json_object
from gateway.json_response import json_response, list_response
from gateway.state import BATCHES, CONFIG, FILES
from shared.errors import ErrorCode

_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
_MAX_METADATA_PAIRS, _MAX_METADATA_KEY, _MAX_METADATA_VALUE = 16, 64, 512
_CANCEL_TRIES = 3  # a cancel that races the driver's own status change reads the batch again


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_REQUEST, message, param=param)


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > _MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and len(k) <= _MAX_METADATA_KEY for k in metadata)
        or not all(isinstance(v, str) and len(v) <= _MAX_METADATA_VALUE for v in metadata.values())
    ):
        raise _invalid(
            "metadata",
            f"metadata must map at most {_MAX_METADATA_PAIRS} keys of at most {_MAX_METADATA_KEY} characters "
            f"to strings of at most {_MAX_METADATA_VALUE}",
        )
    return metadata


async def create_batch(request: web.Request) -> web.Response:
    """`POST /v1/batches`: 200 with the batch object, status `validating`."""
    tenant = await request_tenant(request)
    body = parse_json_object(await request.read())
    if not _FIELDS.issuperset(body):
        unknown = sorted(set(body) - _FIELDS)
        raise _invalid(unknown[0], f"unknown field(s): {', '.join(unknown)}")
    if body.get("endpoint") not in ENDPOINTS:
        raise _invalid("endpoint", f"endpoint must be one of {', '.join(ENDPOINTS)}")
    if body.get("completion_window") != "24h":
        raise _invalid("completion_window", "completion_window must be 24h")
    metadata = _metadata(body)
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise _invalid("input_file_id", "input_file_id must be the id of an uploaded file")
    input_file = await request.app[FILES].get(tenant.tenant_id, file_id)
    if input_file.purpose is not FilePurpose.BATCH:
        raise _invalid("input_file_id", "the input file must have purpose `batch`")
    now = int(time.time() * 1000)
    record = BatchRecord(
        batch_id=new_batch_id(),
        tenant=tenant.tenant_id,
        endpoint=body["endpoint"],
        input_file_id=input_file.file_id,
        created_ms=now,
        expires_ms=now + request.app[CONFIG].batches.completion_window_s * 1000,
        metadata=metadata,
        total=input_file.num_lines,
    )
    await request.app[BATCHES].create(record)
    return json_response(record.openai_object())


async def list_batches(request: web.Request) -> web.Response:
    tenant = await request_tenant(request)
    data = [record.openai_object() for record in await request.app[BATCHES].list(tenant.tenant_id)]
    return list_response(data)


async def get_batch(request: web.Request) -> web.Response:
    tenant = await request_tenant(request)
    record = await request.app[BATCHES].get(tenant.tenant_id, request.match_info["batch_id"])
    return json_response(record.openai_object())


async def cancel_batch(request: web.Request) -> web.Response:
    """`POST /v1/batches/{id}/cancel`: a validating or running batch becomes `cancelling` (its queued lines
    are cancelled, its finished ones kept); a batch in another status is returned as it is."""
    tenant = await request_tenant(request)
    batches = request.app[BATCHES]
    batch_id = request.match_info["batch_id"]
    for _ in range(_CANCEL_TRIES):
        record = await batches.get(tenant.tenant_id, batch_id)
        if record.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            break
        if await batches.set_status(record, BatchStatus.CANCELLING):
            break
    return json_response(record.openai_object())
