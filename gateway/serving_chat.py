"""ServingChat: /v1/chat/completions in OpenAI's shapes over OpenAIServing's one path."""

from __future__ import annotations

from gateway import tools as tool_format
from gateway.protocol import ChatCompletionRequest
from gateway.serving import Delta, OpenAIServing, zero_stats
from gateway.state import ServingState
from specstream import StreamChunk


class ServingChat(OpenAIServing):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def __init__(self, state: ServingState, req: ChatCompletionRequest) -> None:
        super().__init__(state, req, [req.chat_messages(state.engine.template_calls_tools)], choices_per_prompt=req.n)
        self.req: ChatCompletionRequest = req
        # [structured] per choice: tool-call deltas parsed from the streamed reply (None without tools)
        self.parsers = {i: tool_format.parser_for(req.tool_mode) for i in range(req.n)}

    @property
    def max_tokens(self) -> int | None:
        return self.req.requested_max_tokens

    @property
    def logprobs(self) -> int | None:
        return self.req.logprobs_count

    def logprob_entries(self, index: int, chunk: StreamChunk) -> list[dict]:
        token_bytes = self.state.token_bytes

        def entry(token_id: int, logprob: float) -> dict:
            text, raw = token_bytes(token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}

        return [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in chunk.logprobs or []
        ]

    def _logprobs_field(self, entries: list[dict]) -> dict | None:
        return {"content": entries, "refusal": None} if self.req.logprobs else None

    def choice_body(self, index: int, text: str, logprobs: list, finish_reason: str | None) -> dict:
        message = tool_format.assistant_message(text, self.req.tool_mode)  # [structured] content or tool_calls
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs_field(logprobs),
            "finish_reason": tool_format.finish_reason(finish_reason, "tool_calls" in message),
        }

    def opening_choices(self) -> list[dict]:
        """OpenAI's first chunk of each choice: the role, no content yet."""
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.req.n)
        ]

    def chunk_choices(self, delta: Delta) -> list[dict]:
        """Content (or tool-call) chunks when there is text, then OpenAI's separate finishing
        chunk with an empty delta; the speculative stats ride on the first of them."""
        out = []
        parser = self.parsers[delta.index]
        for n, message in enumerate(self._message_deltas(parser, delta)):
            out.append(
                {
                    "index": delta.index,
                    "delta": message,
                    "logprobs": self._logprobs_field(delta.logprobs) if not n else None,
                    "finish_reason": None,
                    "speculative": delta.speculative if not n else zero_stats(delta.speculative),
                }
            )
        if delta.finish_reason is not None:
            made_calls = parser is not None and bool(parser.calls)
            reason = tool_format.finish_reason(delta.finish_reason, made_calls)  # [structured] "tool_calls"
            final = {"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": reason}
            if not out and delta.speculative["tokens"]:
                final["speculative"] = delta.speculative
            out.append(final)
        return out

    @staticmethod
    def _message_deltas(parser: tool_format.ToolCallParser | None, delta: Delta) -> list[dict]:
        """The delta's text as content, or [structured] as content and tool-call deltas."""
        if parser is None:
            return [{"content": delta.text}] if delta.text or delta.logprobs else []
        messages = parser.feed(delta.text) + (parser.finish() if delta.finish_reason is not None else [])
        if not messages and delta.logprobs:
            messages = [{"content": ""}]
        return messages
