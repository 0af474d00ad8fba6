"""ServingCompletion: /v1/completions (legacy text completions) over OpenAIServing's one path."""

from __future__ import annotations

from gateway.protocol import CompletionRequest
from gateway.serving import Delta, OpenAIServing
from gateway.state import ServingState
from specstream import StreamChunk


class ServingCompletion(OpenAIServing):
    object_full = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def __init__(self, state: ServingState, req: CompletionRequest) -> None:
        super().__init__(state, req, req.prompts(), choices_per_prompt=req.n)
        self.req: CompletionRequest = req
        self._offsets: dict[int, int] = {}  # per choice: characters of completion text so far

    @property
    def max_tokens(self) -> int | None:
        return self.req.max_tokens

    @property
    def logprobs(self) -> int | None:
        return self.req.logprobs

    def logprob_entries(self, index: int, chunk: StreamChunk) -> list[dict]:
        """Per token: its text, logprob, alternatives and text_offset. Offsets are into the
        completion text as sent: a chunk's tokens start where its text starts, and a token
        whose own decoding differs (part of a character, a held-back stop) cannot push
        later offsets past the chunk's end."""
        token_bytes = self.state.token_bytes
        base = self._offsets.get(index, 0)
        self._offsets[index] = base + len(chunk.text)
        entries, consumed = [], 0
        for lp in chunk.logprobs or []:
            text = token_bytes(lp.token_id)[0]
            top = {token_bytes(t)[0]: v for t, v in lp.top}
            entries.append(
                {"token": text, "logprob": lp.logprob, "top": top, "offset": base + min(consumed, len(chunk.text))}
            )
            consumed += len(text)
        return entries

    def _logprobs_field(self, entries: list[dict]) -> dict | None:
        if self.req.logprobs is None:
            return None
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries],
            "text_offset": [e["offset"] for e in entries],
        }

    def choice_body(self, index: int, text: str, logprobs: list, finish_reason: str | None) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs_field(logprobs),
            "finish_reason": finish_reason,
        }

    def chunk_choices(self, delta: Delta) -> list[dict]:
        return [
            {
                "index": delta.index,
                "text": delta.text,
                "logprobs": self._logprobs_field(delta.logprobs),
                "finish_reason": delta.finish_reason,
                "speculative": delta.speculative,
            }
        ]
