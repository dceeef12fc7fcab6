"""A file upload's multipart/form-data body, read as a stream with its size bounded (aiohttp's
client_max_size covers only bodies read whole). Whatever is malformed about the body (no boundary,
a truncated part, headers that do not parse, a field that is not UTF-8) is one RequestError with
code `invalid_multipart`: nothing a client sends can make this a 500."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import BodyPartReader, web

from gateway.errors import RequestError
from shared.errors import ErrorCode

_CHUNK_BYTES = 1 << 16
_MAX_FIELD_BYTES = 1024  # a text field (purpose)
_MAX_PARTS = 16


@dataclass(frozen=True, slots=True)
class Upload:
    purpose: str
    filename: str
    content: bytes


def _malformed(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_MULTIPART, message)


async def read_upload(request: web.Request, max_file_bytes: int) -> Upload:
    """The `purpose` field and the `file` part of a multipart body; FILE_TOO_LARGE past `max_file_bytes`."""
    if request.content_type != "multipart/form-data":
        raise _malformed("the body must be multipart/form-data with a `file` part and a `purpose` field")
    try:
        return await _read_parts(request, max_file_bytes)
    except RequestError:
        raise
    except Exception as exc:  # aiohttp's reader raises ValueError, AssertionError, LookupError… on bad input
        raise _malformed(f"the multipart body cannot be read ({type(exc).__name__})") from None


async def _read_parts(request: web.Request, max_file_bytes: int) -> Upload:
    reader = await request.multipart()
    purpose: str | None = None
    file: tuple[str, bytes] | None = None
    for _ in range(_MAX_PARTS):
        part = await reader.next()
        if part is None:
            break
        if not isinstance(part, BodyPartReader):
            raise _malformed("nested multipart parts are not accepted")
        if part.name == "file":
            file = (part.filename or "upload.jsonl", await _read_bounded(part, max_file_bytes, file=True))
        elif part.name == "purpose":
            purpose = (await _read_bounded(part, _MAX_FIELD_BYTES, file=False)).decode().strip()
        else:
            await _read_bounded(part, max_file_bytes, file=False)  # another client's extra field: skipped
    else:
        raise _malformed(f"more than {_MAX_PARTS} parts")
    if file is None:
        raise RequestError(ErrorCode.INVALID_MULTIPART, "no `file` part in the body", param="file")
    if purpose is None:
        raise RequestError(ErrorCode.INVALID_MULTIPART, "no `purpose` field in the body", param="purpose")
    return Upload(purpose, file[0], file[1])


async def _read_bounded(part: BodyPartReader, limit: int, *, file: bool) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read_chunk(_CHUNK_BYTES):
        size += len(chunk)
        if size > limit:
            if file:
                raise RequestError(ErrorCode.FILE_TOO_LARGE, f"the file is larger than {limit} bytes", param="file")
            raise _malformed(f"a form field is larger than {limit} bytes")
        chunks.append(chunk)
    return part.decode(b"".join(chunks))  # undoes a Content-Transfer-Encoding, if the part has one
