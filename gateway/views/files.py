"""OpenAI Files API, as the caller's tenant: upload a batch input file, list, read, download, delete."""

from __future__ import annotations

from aiohttp import web

from gateway.auth import request_tenant
from gateway.batch_input import batch_lines
from gateway.errors import RequestError
from gateway.files import FilePurpose
from gateway.json_response import json_response, list_response
from gateway.state import BATCHES, CONFIG, FILES
from gateway.upload import read_upload
from shared.errors import ErrorCode

_MAX_FILENAME_CHARS = 255


async def upload_file(request: web.Request) -> web.Response:
    """`POST /v1/files` (multipart: `purpose=batch`, `file`): 200 with the file object."""
    tenant = await request_tenant(request)
    limits = request.app[CONFIG].batches
    upload = await read_upload(request, limits.max_file_bytes)
    if upload.purpose != FilePurpose.BATCH:
        raise RequestError(ErrorCode.INVALID_PURPOSE, "purpose must be `batch`", param="purpose")
    lines = batch_lines(upload.content, limits.max_file_lines)
    files = request.app[FILES]
    if await files.count_uploads(tenant.tenant_id) >= limits.max_files_per_tenant:
        raise RequestError(
            ErrorCode.FILE_QUOTA_EXCEEDED,
            f"you keep {limits.max_files_per_tenant} uploaded files already: delete some first",
            param="file",
        )
    filename = upload.filename[:_MAX_FILENAME_CHARS]
    record = await files.create(tenant.tenant_id, filename, FilePurpose.BATCH, lines)
    return json_response(record.openai_object())


async def list_files(request: web.Request) -> web.Response:
    """`GET /v1/files[?purpose=]`: the tenant's files, newest first."""
    tenant = await request_tenant(request)
    purpose = request.query.get("purpose")
    records = [r for r in await request.app[FILES].list(tenant.tenant_id) if purpose is None or r.purpose == purpose]
    data = [record.openai_object() for record in records]
    return list_response(data)


async def get_file(request: web.Request) -> web.Response:
    tenant = await request_tenant(request)
    record = await request.app[FILES].get(tenant.tenant_id, request.match_info["file_id"])
    return json_response(record.openai_object())


async def file_content(request: web.Request) -> web.StreamResponse:
    """`GET /v1/files/{id}/content`: the JSONL, streamed a chunk of lines at a time."""
    tenant = await request_tenant(request)
    files = request.app[FILES]
    record = await files.get(tenant.tenant_id, request.match_info["file_id"])
    response = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
    response.content_length = record.num_bytes
    await response.prepare(request)
    async for chunk in files.content(record):
        await response.write(chunk)
    await response.write_eof()
    return response


async def delete_file(request: web.Request) -> web.Response:
    tenant = await request_tenant(request)
    files = request.app[FILES]
    record = await files.get(tenant.tenant_id, request.match_info["file_id"])
    batch_id = await request.app[BATCHES].active_using(record.file_id)
    if batch_id is not None:  # its lines are read as the batch goes: deleting it would strand the batch
        raise RequestError(
            ErrorCode.CONFLICT, f"the file is the input of batch {batch_id}, which has not finished", param="file_id"
        )
    await files.delete(record)
    return json_response({"id": record.file_id, "object": "file", "deleted": True})
