"""ServingResponses: POST /v1/responses (the OpenAI Responses API) over chat's path.

The request is translated into the chat request it asks for (gateway/protocol_responses.py), so
validation, the engine jobs, the tool-call grammar and parser and OpenAIServing's one
chunk-to-delta path are chat's own. gateway/reply.py turns the deltas into output items (a
message, or function calls); a streamed response sends them as the Responses API's typed events,
each with a sequence_number, and its deltas carry the speculative counts as an extra field, as
chat's chunks do. A response that max_output_tokens cut short ends with response.completed too,
its status "incomplete" (as vLLM does; OpenAI's own stream would send response.incomplete).
With store: true the finished response and its conversation go to the ResponseStore."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator

from starlette.responses import JSONResponse, Response

from gateway.choices import Choices
from gateway.errors import APIError, params_renamed, renamed
from gateway.protocol_responses import NamedFunctionChoice, ResponsesRequest, parse_item
from gateway.reply import Block, BlockEvent, Reply, collect_reply
from gateway.serving_chat import ServingChat
from gateway.state import ServingState

# Chat's names for the fields a Responses request sets, as the Responses API names them.
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "tool_choice.function.name": "tool_choice.name",
}
NO_STATS = {"drafted": 0, "accepted": 0, "tokens": 0}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ServingResponses(ServingChat):
    id_prefix = "resp"
    prompt_param = "input"

    def __init__(self, state: ServingState, req: ResponsesRequest, history: list[dict], owner: str) -> None:
        """history: the stored conversation previous_response_id continues; owner: the store's shelf."""
        self.responses_req = req
        self.history = history
        self.owner = owner
        with params_renamed(PARAMS):
            chat = req.chat_request([parse_item(raw, "previous_response_id") for raw in history])
            super().__init__(state, chat)
        self.request_id = f"resp_{uuid.uuid4().hex}"

    def validate(self):
        with params_renamed(PARAMS):
            return super().validate()

    def error(self, exc: BaseException) -> APIError:
        return renamed(super().error(exc), PARAMS)

    # ------------------------------------------------------------------ bodies
    def body(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        req = self.responses_req
        choice = req.tool_choice
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.state.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text_config(),
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunctionChoice) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    @staticmethod
    def item(block: Block, status: str) -> dict:
        """One output item; while in progress, as the stream first announces it."""
        done = status != "in_progress"
        if block.kind == "text":
            content = [text_part(block.text)] if done else []
            return {
                "id": f"msg_{block.uid}",
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "id": f"fc_{block.uid}",
            "type": "function_call",
            "status": status,
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.text if done else "",
        }

    @staticmethod
    def item_status(reply: Reply, last: bool) -> str:
        return "incomplete" if last and reply.finish_reason == "length" else "completed"

    def usage_body(self) -> dict:
        usage = self.usage.body()
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }

    def finished(self, reply: Reply) -> dict:
        """The finished response, stored when the request asked for it."""
        last = len(reply.blocks) - 1
        output = [self.item(b, self.item_status(reply, i == last)) for i, b in enumerate(reply.blocks)]
        status = "incomplete" if reply.finish_reason == "length" else "completed"
        body = self.body(status, output, self.usage_body())
        if self.responses_req.store:
            items = [item.model_dump(exclude_none=True) for item in self.responses_req.items()]
            self.state.responses.put(self.owner, self.request_id, body, self.history + items + output)
        return body

    # ---------------------------------------------------------------- responses
    async def full(self, choices: Choices) -> Response:
        reply = await collect_reply(self, choices)
        return JSONResponse(self.finished(reply))

    async def events(self, choices: Choices) -> AsyncIterator[dict]:
        numbers = itertools.count()

        def sse(kind: str, fields: dict) -> dict:
            payload = {"type": kind, **fields, "sequence_number": next(numbers)}
            return {"event": kind, "data": json.dumps(payload, ensure_ascii=False)}

        opening = self.body("in_progress", [])
        yield sse("response.created", {"response": opening})
        yield sse("response.in_progress", {"response": opening})
        reply = Reply(self.parsers[0])
        try:
            async for delta in self.deltas(choices):
                for event in reply.feed(delta):
                    for kind, fields in self.item_events(event, reply):
                        yield sse(kind, fields)
        except Exception as exc:  # noqa: BLE001 - the status is sent: report it as an error event
            error = self.error(exc)
            code = error.code or error.body()["error"]["type"]
            yield sse("error", {"code": code, "message": error.message, "param": error.param})
            return
        yield sse("response.completed", {"response": self.finished(reply)})

    def item_events(self, event: BlockEvent, reply: Reply) -> Iterator[tuple[str, dict]]:
        """The typed events of one block event."""
        block, text = event.block, event.block.kind == "text"
        where = {"item_id": self.item(block, "in_progress")["id"], "output_index": event.index}
        if text:
            where["content_index"] = 0
        if event.kind == "start":
            yield "response.output_item.added", {"output_index": event.index, "item": self.item(block, "in_progress")}
            if text:
                yield "response.content_part.added", {**where, "part": text_part("")}
        elif event.kind == "delta":
            kind = "response.output_text.delta" if text else "response.function_call_arguments.delta"
            extra = {"logprobs": []} if text else {}
            yield kind, {**where, "delta": event.text, **extra, "speculative": event.speculative or NO_STATS}
        else:
            stats = {"speculative": event.speculative} if event.speculative else {}
            if text:
                yield "response.output_text.done", {**where, "text": block.text, "logprobs": [], **stats}
                yield "response.content_part.done", {**where, "part": text_part(block.text)}
            else:
                done = {"name": block.name, "arguments": block.text}
                yield "response.function_call_arguments.done", {**where, **done, **stats}
            status = self.item_status(reply, event.final)
            yield "response.output_item.done", {"output_index": event.index, "item": self.item(block, status)}
