"""specstream_client: a small typed httpx SDK for OpenAI-style servers (specstream's or any other).

Speaks HTTP only; imports neither specstream nor gateway.

    from specstream_client import Client
    with Client("http://127.0.0.1:8000/v1") as c:
        for text in c.chat.completions.stream_text(model="smollm2-135m", messages=[...]):
            print(text, end="")
        with c.responses.stream(model="smollm2-135m", input="Hi") as stream:
            for text in stream.text_deltas():
                print(text, end="")
"""

from specstream_client._client import AsyncClient, AsyncStream, Client, Stream
from specstream_client._exceptions import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
)
from specstream_client._responses import AsyncResponseStream, ResponseStream
from specstream_client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    FunctionCall,
    Model,
    OutputItem,
    Response,
    ResponseEvent,
    ResponseUsage,
    SpeculativeStats,
    ToolCall,
    ToolCallAssembler,
    ToolCallDelta,
    Usage,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncResponseStream",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Client",
    "Completion",
    "FunctionCall",
    "InternalServerError",
    "Model",
    "NotFoundError",
    "OutputItem",
    "RateLimitError",
    "Response",
    "ResponseEvent",
    "ResponseStream",
    "ResponseUsage",
    "SpeculativeStats",
    "Stream",
    "ToolCall",
    "ToolCallAssembler",
    "ToolCallDelta",
    "Usage",
]
