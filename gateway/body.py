"""Reading a POST body: JSON only (by Content-Type), bounded in size, and valid Unicode.

The Content-Type check closes the browser hole of FastAPI's CVE-2021-32677: a web page may
POST text/plain, form or multipart bodies cross-origin without a CORS preflight, so a
server that parses those as JSON lets any page a user visits drive a local server."""

from __future__ import annotations

import json

from starlette.requests import Request

from gateway.errors import APIError

JSON_MEDIA_TYPE = "application/json"


def require_json_content_type(request: Request) -> None:
    """application/json, optionally with charset=utf-8 (JSON is UTF-8 by RFC 8259)."""
    header = request.headers.get("content-type", "")
    media_type, *params = (part.strip().lower() for part in header.split(";"))
    charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
    if media_type != JSON_MEDIA_TYPE or any(c not in ("utf-8", "utf8") for c in charsets):
        shown = header[:80] or "none"
        raise APIError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json' (got {shown!r})",
            code="unsupported_media_type",
        )


async def read_bounded(request: Request, max_bytes: int) -> bytes:
    too_large = APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


def _reject_constant(name: str):
    raise APIError(400, f"invalid JSON number {name}: NaN and Infinity are not allowed")


def parse_json_object(raw: bytes) -> dict:
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except APIError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_unicode(data: dict) -> None:
    """400 for a string anywhere (keys included) that is not valid Unicode: JSON escapes can
    spell lone surrogates ("\\ud800"), which no tokenizer, log line or response can encode."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                where = path[:100]
                raise APIError(400, f"'{where}' is not valid Unicode text (it holds a lone surrogate)", param=where)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    where = path[:100] or None
                    raise APIError(400, f"a key in '{where or 'the body'}' holds a lone surrogate", param=where)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


async def read_json_object(request: Request, max_bytes: int) -> dict:
    require_json_content_type(request)
    data = parse_json_object(await read_bounded(request, max_bytes))
    check_unicode(data)
    return data
