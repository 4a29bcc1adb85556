"""A multipart upload (`POST /v1/files`) streamed straight into a file: the request is parsed as it arrives
(python-multipart's push parser), the file part's bytes go to disk and its lines are counted on the way, so
memory stays bounded at any size, and the limits stop an upload as soon as it passes them."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from layerbus.serve.errors import ApiError

# The most bytes of a form field other than the file (purpose is a word).
MAX_FIELD_BYTES = 1024
# The most parts a request may have: the file and purpose, and a few more that are ignored.
MAX_PARTS = 8


@dataclass
class Upload:
    """What an upload delivered: its form fields, and its file's name, size and lines (written to `path`)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    bytes: int = 0
    lines: int = 0
    # Whether the file's last byte was a newline (a last line without one still counts).
    ends_with_newline: bool = True


def boundary_of(content_type: str | None) -> bytes:
    """The multipart boundary of a Content-Type header; ApiError 415 for any other content type."""
    kind, options = parse_options_header(content_type or "")
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise ApiError(415, f"POST /v1/files takes multipart/form-data with a file and purpose=batch, not "
                            f"{(content_type or 'no content type')!r}: upload with the openai client's "
                            "files.create(file=..., purpose='batch') or `curl -F file=@batch.jsonl -F purpose=batch`",
                       code="unsupported_media_type")
    return options[b"boundary"]


def check_filename(name: str) -> str:
    """A file name as given, when it is a plain name; ApiError 400 for folders, `..`, control characters."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or ".." in name
            or any(ord(c) < 32 or ord(c) == 127 for c in name) or len(name) > 255):
        raise ApiError(400, f"file name {name!r} is not a plain file name (no folders, '..' or control characters, "
                            "at most 255 characters): upload it under its base name", code="invalid_filename",
                       param="file")
    return name


class UploadParser:
    """Parses one multipart request into `target` (the file part) and small fields, within the limits."""

    def __init__(self, boundary: bytes, target: BinaryIO, max_bytes: int, max_lines: int) -> None:
        self.upload = Upload()
        self._target = target
        self._max_bytes = max_bytes
        self._max_lines = max_lines
        self._parts = 0
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._is_file = False
        self._field_value = bytearray()
        self._ended = False
        self._parser = MultipartParser(boundary, {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field_data,
            "on_header_value": self._header_value_data, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end, "on_end": self._end})

    async def feed(self, chunks: AsyncIterator[bytes]) -> Upload:
        try:
            async for chunk in chunks:
                if chunk:
                    self._parser.write(chunk)
            self._parser.finalize()
        except MultipartParseError as error:
            raise ApiError(400, f"the multipart body could not be read ({error}): send it as the openai client or "
                                "`curl -F` does", code="invalid_multipart") from None
        if not self._ended:
            raise ApiError(400, "the multipart body ended before its closing boundary: the upload was cut off; "
                                "send it again", code="invalid_multipart")
        if self.upload.filename is None:
            raise ApiError(400, "the upload has no file part: send the JSONL as the form field `file`",
                           code="missing_file", param="file")
        if self.upload.bytes and not self.upload.ends_with_newline:
            self.upload.lines += 1
        return self.upload

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise ApiError(400, f"the upload has more than {MAX_PARTS} parts: send the fields file and purpose only",
                           code="invalid_multipart")
        self._headers, self._name, self._is_file = {}, None, False
        self._field_value = bytearray()

    def _header_field_data(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]
        self._check_header_size()

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        self._check_header_size()

    def _check_header_size(self) -> None:
        if len(self._header_field) + len(self._header_value) > MAX_FIELD_BYTES * 4:
            raise ApiError(400, "a part's header is over 4 KiB: send the file with a plain name",
                           code="invalid_multipart")

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field, self._header_value = bytearray(), bytearray()

    def _headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get(b"content-disposition"))
        if disposition != b"form-data" or b"name" not in options:
            raise ApiError(400, "a part has no `Content-Disposition: form-data; name=...` header: send the upload "
                                "as a form", code="invalid_multipart")
        self._name = options[b"name"].decode("utf-8", "replace")
        if self._name == "file":
            if self.upload.filename is not None:
                raise ApiError(400, "the upload has two file parts: send one file per request", code="invalid_multipart",
                               param="file")
            raw = options.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
            self.upload.filename = check_filename(raw)
            self._is_file = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if not self._is_file:
            self._field_value += data[start:end]
            if len(self._field_value) > MAX_FIELD_BYTES:
                raise ApiError(400, f"form field {self._name!r} is over {MAX_FIELD_BYTES} bytes: only `file` may be "
                                    "large", code="invalid_multipart", param=self._name)
            return
        piece = data[start:end]
        if not piece:
            return
        upload = self.upload
        upload.bytes += len(piece)
        upload.lines += piece.count(b"\n")
        upload.ends_with_newline = piece.endswith(b"\n")
        if upload.bytes > self._max_bytes:
            raise ApiError(413, f"the file is over this server's limit of {self._max_bytes:,} bytes: split it into "
                                "several batches", code="file_too_large", param="file")
        if upload.lines > self._max_lines:
            raise ApiError(413, f"the file has more than this server's limit of {self._max_lines:,} lines: split it "
                                "into several batches", code="too_many_lines", param="file")
        self._target.write(piece)

    def _part_end(self) -> None:
        if not self._is_file and self._name is not None:
            try:
                self.upload.fields[self._name] = self._field_value.decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, f"form field {self._name!r} is not UTF-8 text", code="invalid_multipart",
                               param=self._name) from None

    def _end(self) -> None:
        self._ended = True


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
