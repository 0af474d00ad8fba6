"""ServingMessages: POST /v1/messages (the Anthropic Messages API) over chat's path.

The request is translated into the chat request it asks for (gateway/protocol_messages.py), so
validation, the engine jobs, the tool-call grammar and parser and OpenAIServing's one
chunk-to-delta path are chat's own; gateway/reply.py turns the deltas into content blocks (text,
tool_use). Streamed, they go out as Anthropic's named events (message_start, ping,
content_block_start/delta/stop, message_delta, message_stop), the deltas with the speculative
counts as an extra field; errors take Anthropic's shape, mid-stream as an `error` event.

Usage follows Anthropic's split: input_tokens counts the prompt tokens not read from the prefix
cache, cache_read_input_tokens those that were (message_start, sent before that is known, counts
the whole prompt as input; message_delta's totals replace it)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

from starlette.responses import JSONResponse, Response

from gateway.choices import Choices
from gateway.errors import APIError, params_renamed, renamed
from gateway.protocol_messages import MessagesRequest
from gateway.reply import Block, BlockEvent, Reply, collect_reply
from gateway.serving_chat import ServingChat
from gateway.state import ServingState

# Chat's names for the fields a Messages request sets, as the Messages API names them.
PARAMS = {
    "stop": "stop_sequences",
    "tool_choice.function.name": "tool_choice.name",
    "response_format.json_schema.schema": "output_config.format.schema",
    "response_format": "output_config.format",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}
NO_STATS = {"drafted": 0, "accepted": 0, "tokens": 0}


def tool_use_id(call_id: str) -> str:
    """Chat's call_<hex> as Anthropic's toolu_<hex>."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object tool_use carries ({} for arguments cut short by max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ServingMessages(ServingChat):
    id_prefix = "msg"
    prompt_param = "messages"

    def __init__(self, state: ServingState, req: MessagesRequest) -> None:
        self.messages_req = req
        with params_renamed(PARAMS):
            super().__init__(state, req.chat_request())
        self.request_id = f"msg_{uuid.uuid4().hex}"

    def validate(self):
        with params_renamed(PARAMS):
            return super().validate()

    def error(self, exc: BaseException) -> APIError:
        return renamed(super().error(exc), PARAMS)

    # ------------------------------------------------------------------ bodies
    @staticmethod
    def content_block(block: Block, done: bool = True) -> dict:
        if block.kind == "text":
            return {"type": "text", "text": block.text if done else ""}
        arguments = tool_input(block.text) if done else {}
        return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name, "input": arguments}

    @staticmethod
    def stop(reply: Reply) -> dict:
        """stop_reason and stop_sequence."""
        if reply.finish_reason == "stop" and reply.stop_string is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": reply.stop_string}
        if reply.finish_reason == "stop" and reply.made_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        return {"stop_reason": STOP_REASONS.get(reply.finish_reason or "stop", "end_turn"), "stop_sequence": None}

    def usage_body(self) -> dict:
        usage = self.usage.body()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": usage["prompt_tokens"] - cached,
            "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def message(self, content: list[dict], stop: dict, usage: dict) -> dict:
        return {
            "id": self.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_name,
            "content": content,
            **stop,
            "usage": usage,
        }

    # ---------------------------------------------------------------- responses
    async def full(self, choices: Choices) -> Response:
        reply = await collect_reply(self, choices)
        content = [self.content_block(b) for b in reply.blocks]
        return JSONResponse(self.message(content, self.stop(reply), self.usage_body()))

    async def events(self, choices: Choices) -> AsyncIterator[dict]:
        def sse(kind: str, fields: dict) -> dict:
            return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}

        opening = {"input_tokens": choices.prompt_tokens(0), "output_tokens": 0}
        opening |= {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        yield sse("message_start", {"message": self.message([], {"stop_reason": None, "stop_sequence": None}, opening)})
        yield sse("ping", {})
        reply = Reply(self.parsers[0])
        try:
            async for delta in self.deltas(choices):
                for event in reply.feed(delta):
                    for kind, fields in self.block_events(event):
                        yield sse(kind, fields)
        except Exception as exc:  # noqa: BLE001 - the status is sent: report it as an error event
            yield {"event": "error", "data": self.error(exc).json(anthropic=True)}
            return
        yield sse("message_delta", {"delta": self.stop(reply), "usage": self.usage_body()})
        yield sse("message_stop", {})

    def block_events(self, event: BlockEvent) -> Iterator[tuple[str, dict]]:
        if event.kind == "start":
            yield "content_block_start", {"index": event.index, "content_block": self.content_block(event.block, False)}
        elif event.kind == "delta":
            if event.block.kind == "text":
                delta = {"type": "text_delta", "text": event.text}
            else:
                delta = {"type": "input_json_delta", "partial_json": event.text}
            yield (
                "content_block_delta",
                {"index": event.index, "delta": delta, "speculative": event.speculative or NO_STATS},
            )
        else:
            stats = {"speculative": event.speculative} if event.speculative else {}
            yield "content_block_stop", {"index": event.index, **stats}
