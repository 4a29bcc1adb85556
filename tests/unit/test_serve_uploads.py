"""The upload parser (serve/uploads.py) on request bodies as they arrive in chunks: the file's bytes and lines,
the limits, names with folders in them, and bodies that are not well-formed multipart, each refused with a 4xx."""

from __future__ import annotations

import asyncio
import io

import pytest

from layerbus.serve.errors import ApiError
from layerbus.serve.uploads import UploadParser, boundary_of, check_filename

BOUNDARY = "b0undary"


def body(content: bytes, filename: str = "in.jsonl", purpose: str = "batch") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()


def parse(data: bytes, chunk: int = 7, max_bytes: int = 1 << 20, max_lines: int = 100):
    target = io.BytesIO()

    async def chunks():
        for start in range(0, len(data), chunk):
            yield data[start : start + chunk]

    upload = asyncio.run(UploadParser(BOUNDARY.encode(), target, max_bytes, max_lines).feed(chunks()))
    return upload, target.getvalue()


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_file_arrives_whole_whatever_the_chunks(chunk):
    content = b'{"a": 1}\n{"b": 2}\n{"c": 3}'

    upload, written = parse(body(content), chunk)

    assert written == content and upload.bytes == len(content) and upload.lines == 3
    assert upload.fields == {"purpose": "batch"} and upload.filename == "in.jsonl"


@pytest.mark.parametrize("limits, code", [({"max_lines": 2}, "too_many_lines"), ({"max_bytes": 10}, "file_too_large")])
def test_limits_stop_the_upload(limits, code):
    with pytest.raises(ApiError) as refused:
        parse(body(b"{}\n" * 5), **limits)
    assert refused.value.status == 413 and refused.value.code == code


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b.jsonl", "..", "a\\b", "x\x00y", ""])
def test_names_with_folders_are_refused(name):
    with pytest.raises(ApiError) as refused:
        check_filename(name)
    assert refused.value.status == 400 and refused.value.code == "invalid_filename"


@pytest.mark.parametrize("data", [body(b"{}\n")[:-12], b"\x00\xff" * 50, b"--b0undary\r\nno headers\r\n\r\n",
                                  body(b"{}\n").replace(b'name="file"; filename="in.jsonl"', b'name="other"')])
def test_malformed_bodies_are_refused_with_400(data):
    with pytest.raises(ApiError) as refused:
        parse(data)
    assert refused.value.status == 400


@pytest.mark.parametrize("content_type", [None, "application/json", "multipart/form-data", "text/plain; boundary=x"])
def test_other_content_types_are_refused_with_415(content_type):
    with pytest.raises(ApiError) as refused:
        boundary_of(content_type)
    assert refused.value.status == 415 and "multipart/form-data" in refused.value.message
