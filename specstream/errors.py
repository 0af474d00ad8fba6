"""One exception hierarchy for the engine; the gateway maps each class to an HTTP status."""

from __future__ import annotations


class SpecstreamError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(SpecstreamError, ValueError):
    """The request itself is wrong (bad prompt, bad parameters, too long for the context)."""


class QueueFull(SpecstreamError):
    """The waiting queue is at its limit; retry later."""


class RequestFailed(SpecstreamError):
    """This request failed while generating; other requests were not affected."""


class EngineDeadError(SpecstreamError):
    """The engine hit an error it cannot recover from; every open stream fails with this."""
