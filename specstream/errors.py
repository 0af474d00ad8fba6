"""One exception hierarchy for the engine; the gateway maps each class to an HTTP status."""

from __future__ import annotations


class SpecstreamError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(SpecstreamError, ValueError):
    """The request itself is wrong (bad prompt, bad parameters, too long for the context).
    param names the offending field and code a machine-readable reason, when known."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFull(SpecstreamError):
    """The waiting queue is at its limit; retry later."""


class RequestFailed(SpecstreamError):
    """This request failed while generating; other requests were not affected."""


class EngineDeadError(SpecstreamError):
    """The engine hit an error it cannot recover from; every open stream fails with this."""
