"""One choice's reply as content blocks, for the APIs whose output is a list of them (OpenAI
Responses: output items; Anthropic Messages: content blocks).

Reply reads the deltas of OpenAIServing's one chunk-to-delta path through the same tool-call
parser chat uses (gateway/tools.py), and turns them into blocks, each plain text or one function
call, with events as they open, grow and close. Each endpoint maps these events onto its own
stream events and the finished blocks onto its own body, so a streamed reply and the same
reply unstreamed are built by one path.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gateway.serving import Delta, add_stats
from gateway.tools import ToolCallParser


@dataclass
class Block:
    kind: str  # "text" or "call"
    uid: str  # unique; an endpoint prefixes it into its own id (msg_..., fc_...)
    text: str = ""  # the text, or the call's arguments (JSON text as the model wrote it)
    call_id: str = ""  # a call's id (call_...), as chat would give it
    name: str = ""  # a call's function


@dataclass
class BlockEvent:
    kind: str  # "start", "delta" or "stop"
    index: int  # the block's position in the reply
    block: Block
    text: str = ""  # a delta's text or argument fragment
    speculative: dict | None = None  # drafted/accepted/tokens of the rounds since the previous event that had them
    final: bool = False  # a stop event that ends the reply


def _zero_stats() -> dict:
    return {"drafted": 0, "accepted": 0, "tokens": 0}


@dataclass
class Reply:
    """feed() each Delta of one choice; blocks holds the reply so far, finish_reason and
    stop_string how it ended. A reply that finishes with no block gets one empty text block."""

    parser: ToolCallParser | None  # None: no tools in play, every delta is text
    blocks: list[Block] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    _open: Block | None = None
    _stats: dict = field(default_factory=_zero_stats)

    @property
    def made_calls(self) -> bool:
        return any(b.kind == "call" for b in self.blocks)

    def feed(self, delta: Delta) -> list[BlockEvent]:
        add_stats(self._stats, delta.speculative)
        events: list[BlockEvent] = []
        for message in self._messages(delta):
            if message.get("content"):
                self._grow("text", message["content"], events)
            for piece in message.get("tool_calls", ()):
                if "id" in piece:
                    self._start(
                        Block("call", uuid.uuid4().hex[:24], call_id=piece["id"], name=piece["function"]["name"]),
                        events,
                    )
                self._grow("call", piece["function"].get("arguments") or "", events)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_string = delta.finish_reason, delta.stop_string
            if not self.blocks:
                self._start(Block("text", uuid.uuid4().hex[:24]), events)
            self._stop(events, final=True)
        return events

    def _messages(self, delta: Delta) -> list[dict]:
        """The delta as chat's content and tool-call deltas."""
        if self.parser is None:
            return [{"content": delta.text}] if delta.text else []
        return self.parser.feed(delta.text) + (self.parser.finish() if delta.finish_reason is not None else [])

    def _take_stats(self) -> dict | None:
        stats, self._stats = self._stats, _zero_stats()
        return stats if stats["tokens"] else None

    def _start(self, block: Block, events: list[BlockEvent]) -> None:
        self._stop(events)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("start", len(self.blocks) - 1, block))

    def _grow(self, kind: str, text: str, events: list[BlockEvent]) -> None:
        if self._open is None or self._open.kind != kind:
            self._start(Block(kind, uuid.uuid4().hex[:24]), events)
        if text:
            block = self._open
            assert block is not None
            block.text += text
            events.append(BlockEvent("delta", len(self.blocks) - 1, block, text, self._take_stats()))

    def _stop(self, events: list[BlockEvent], final: bool = False) -> None:
        """Close the open block; the last one takes the counts of rounds that added no text."""
        if self._open is not None:
            stats = self._take_stats() if final else None
            events.append(BlockEvent("stop", len(self.blocks) - 1, self._open, speculative=stats, final=final))
            self._open = None


async def collect_reply(serving, choices) -> Reply:
    """A whole (unstreamed) reply: every delta of the request's one choice fed into a Reply, through
    `serving`'s own delta path and error shape (a ServingChat subclass); the choice's stream is closed."""
    reply = Reply(serving.parsers[0])
    try:
        async for delta in serving.deltas(choices):
            reply.feed(delta)
    except Exception as exc:
        raise serving.error(exc) from None
    finally:
        await choices.close()
    return reply
