"""OpenAI's Files API: upload a batch input, list, retrieve, download and delete files.

An upload streams into the server's files folder (serve/uploads.py) under a name the server chooses, never the
client's; the client's name is kept as the file's `filename` only. A key sees only its own files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from layerbus.serve.errors import ApiError
from layerbus.serve.server import Server, new_id, unix
from layerbus.serve.uploads import UploadParser, boundary_of, remove_quietly
from layerbus.storage.api_records import ApiFile

router = APIRouter()
PURPOSES = ("batch",)


def file_object(record: ApiFile) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": unix(record.created_at),
            "filename": record.filename, "purpose": record.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def owned_file(server: Server, request: Request, file_id: str) -> ApiFile:
    """The file, when the caller may see it; 404 otherwise (another key's file is not said to exist)."""
    caller = server.caller(request)
    record = server.api.file(file_id)
    if record is None or not caller.sees(record.owner):
        raise ApiError(404, f"no file {file_id!r} for this key: GET /v1/files lists yours", code="file_not_found",
                       param="file_id")
    return record


@router.post("/v1/files")
async def create_file(request: Request) -> dict[str, Any]:
    server: Server = request.app.state.server
    caller = server.caller(request)
    boundary = boundary_of(request.headers.get("content-type"))
    config = server.config
    file_id = new_id("file-")
    path = config.files_dir / f"{file_id}.jsonl"
    try:
        with path.open("wb", buffering=1 << 20) as target:
            parser = UploadParser(boundary, target, config.max_file_bytes, config.max_file_lines)
            upload = await parser.feed(request.stream())
        purpose = upload.fields.get("purpose")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose {purpose!r} is not one this server takes: upload batch inputs with "
                                "purpose='batch'", code="invalid_purpose", param="purpose")
        record = ApiFile(id=file_id, owner=caller.owner, filename=upload.filename or "upload.jsonl", purpose=purpose,
                         bytes=upload.bytes, lines=upload.lines, path=str(path), created_at=server.now())
        server.api.add_file(record)
    except BaseException:
        remove_quietly(path)
        raise
    return file_object(record)


@router.get("/v1/files")
def list_files(request: Request, limit: int = Query(10000, ge=1, le=10000), after: str | None = None,
               purpose: str | None = None) -> dict[str, Any]:
    server: Server = request.app.state.server
    caller = server.caller(request)
    found = server.api.files(None if caller.admin else caller.owner, limit + 1, after, purpose)
    page = [file_object(record) for record in found[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(found) > limit}


@router.get("/v1/files/{file_id}")
def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
    return file_object(owned_file(request.app.state.server, request, file_id))


@router.get("/v1/files/{file_id}/content")
def file_content(request: Request, file_id: str) -> FileResponse:
    record = owned_file(request.app.state.server, request, file_id)
    if not Path(record.path).is_file():
        raise ApiError(404, f"file {file_id!r} has no content on this server any more (its {record.path} is gone); "
                            "upload it again", code="file_not_found", param="file_id")
    return FileResponse(record.path, media_type="application/jsonl", filename=record.filename)


@router.delete("/v1/files/{file_id}")
def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    server: Server = request.app.state.server
    record = owned_file(server, request, file_id)
    server.api.delete_file(record.id)
    remove_quietly(Path(record.path))
    return {"id": record.id, "object": "file", "deleted": True}
