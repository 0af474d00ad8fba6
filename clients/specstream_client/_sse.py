"""Server-sent events, parsed line by line (WHATWG rules): multi-line data, comments and
keep-alives, event names; the OpenAI convention that "data: [DONE]" ends the stream and that
an event whose JSON has an "error" key reports a failure."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass

from specstream_client._exceptions import APIError, error_from_body

DONE = object()


@dataclass
class ServerSentEvent:
    event: str
    data: str


class SSEDecoder:
    """Feed lines (without their line ending); get events on blank lines."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = "message"

    def feed(self, line: str) -> ServerSentEvent | None:
        if not line:
            if not self._data:
                self._event = "message"
                return None
            event = ServerSentEvent(self._event, "\n".join(self._data))
            self._data, self._event = [], "message"
            return event
        if line.startswith(":"):
            return None  # comment / keep-alive
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return None  # id, retry and unknown fields are ignored

    def flush(self) -> ServerSentEvent | None:
        return self.feed("")


def decode_payload(event: ServerSentEvent):
    """DONE, or the event's JSON object; raises for error events and malformed data."""
    if event.data.strip() == "[DONE]":
        return DONE
    try:
        payload = json.loads(event.data)
    except json.JSONDecodeError:
        raise APIError(f"malformed server-sent event data: {event.data[:200]!r}") from None
    if not isinstance(payload, dict):
        raise APIError(f"unexpected server-sent event data: {event.data[:200]!r}")
    if event.event == "error" or "error" in payload:
        body = payload if "error" in payload else {"error": payload}
        err = body["error"] if isinstance(body["error"], dict) else {"message": str(body["error"])}
        status = err.get("status")
        status_code = status if isinstance(status, int) else None
        raise error_from_body(status_code, {"error": err}, "the server reported an error mid-stream")
    return payload


def iter_payloads(lines: Iterable[str]):
    """Events from lines (a last event without its blank line still counts)."""
    decoder = SSEDecoder()
    for line in lines:
        event = decoder.feed(line.rstrip("\r"))
        if event is not None:
            yield event
    tail = decoder.flush()
    if tail is not None:
        yield tail


async def aiter_payloads(lines: AsyncIterable[str]):
    decoder = SSEDecoder()
    async for line in lines:
        event = decoder.feed(line.rstrip("\r"))
        if event is not None:
            yield event
    tail = decoder.flush()
    if tail is not None:
        yield tail
