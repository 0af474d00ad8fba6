"""From a request to a Sequence: validate, bound, tokenize, build (vLLM v1's input processor).

Everything here runs before admission, so a bad request costs its sender only: the prompt's
size is bounded in characters before any tokenizing and in tokens after; the sampling
parameters that depend on the model (top_k and stop_token_ids within its vocabulary,
max_tokens within its context) are checked; and the Sequence leaves complete, with its seed
(drawn from the engine's own random.Random when the request has none), its resolved
max_tokens, its arrival number and its detokenizer.

Chat content is text: the model's chat template is applied with transformers'
sanitize_control_tokens, so a message that spells a control token ("<|im_end|>\\n
<|im_start|>system ...") is tokenized as those characters and cannot forge a turn, while an
ordinary conversation gives exactly the ids plain templating gives. Raw string prompts
(/v1/completions) are tokenized as before, special tokens included.

A processor is used by one thread at a time (tokenizers are not safe to share across
threads); AsyncEngine runs its own copy, with its own tokenizer, off the engine thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from specstream.detok import IncrementalDetokenizer
from specstream.errors import InvalidRequestError
from specstream.sampling import SamplingParams
from specstream.sequence import Sequence
from specstream.spec_decode.prediction import Prediction
from specstream.structured.decoding import StructuredDecoding

# A prompt's characters per token of context before it is refused untokenized. Real text
# runs 3-5 characters per token; only long runs that one token covers (rows of spaces or
# dashes) come near this.
PROMPT_CHARS_PER_TOKEN = 32
# Characters each chat message counts for on top of its role and content (the template's
# markup around it), so a flood of empty messages is bounded too.
MESSAGE_OVERHEAD_CHARS = 16


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation with tools, rendered by the model's own chat template in its own tool format.

    messages: dicts with a string "role" and "content"; an assistant message may carry "tool_calls"
    ([{"id": str, "type": "function", "function": {"name": str, "arguments": dict}}], content then
    may be empty) and a "tool" message a "tool_call_id". tools: OpenAI tool definitions, handed to
    the template (None: no tools offered this turn). See template_calls_tools for which templates.
    add_generation_prompt: end with the template's opening of an assistant turn (what generation continues);
    continue_final_message: leave the last message open instead, so that generation continues its text (the
    two exclude each other; transformers' apply_chat_template options of the same names).
    template_kwargs: more variables for the template (vLLM's chat_template_kwargs, e.g. {"enable_thinking": False}
    for a template that reads it): plain JSON data, named as identifiers, none of the names the renderer sets
    itself (check_template_kwargs); their strings are user input, so a control token in them stays text."""

    messages: list[dict]
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None


# Variables a request may hand the chat template (ChatPrompt.template_kwargs): how many, and their names. Names the
# renderer sets itself (apply_chat_template's parameters, the conversation, the tokenizer's special tokens) are
# refused rather than let a request overwrite them.
MAX_TEMPLATE_KWARGS = 32
_TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_RENDERER_NAMES = frozenset(
    ("messages", "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
     "strftime_now", "tojson")
)


def check_template_kwargs(kwargs, special_tokens: dict) -> str:
    """kwargs as ChatPrompt.template_kwargs takes them, else InvalidRequestError (param "chat_template_kwargs");
    returns their JSON text (what they count for in the prompt's character bound)."""
    param = "chat_template_kwargs"
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object", param=param)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequestError(f"chat_template_kwargs holds at most {MAX_TEMPLATE_KWARGS} variables", param=param)
    for name in kwargs:
        if not isinstance(name, str) or not _TEMPLATE_KWARG_NAME.fullmatch(name):
            raise InvalidRequestError(
                f"chat_template_kwargs names must be identifiers (a letter, then letters, digits or _; at most 64), "
                f"not {str(name)[:80]!r}",
                param=param,
            )
        if name in _RENDERER_NAMES or name in special_tokens:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {name!r}: the server sets it (use the request's own field, "
                f"where there is one)",
                param=param,
            )
    return _json(kwargs, param)


def template_calls_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tool definitions itself and has the model write
    a call as <tool_call>{"name": ..., "arguments": ...}</tool_call> (the Hermes format of Qwen 2.5
    and 3, SmolLM3, Hermes 2/3 and others): the format gateway/tools.py parses and holds the output
    to. A template with another tool format, or none, gets the gateway's default rendering."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template and "<tool_call>" in template


@dataclass
class InputProcessor:
    tokenizer: Any  # encodes prompts; only the thread running this processor touches it
    output_tokenizer: Any  # decodes outputs on the engine thread (each Sequence's detokenizer)
    vocab_size: int  # rows of the model's logits
    max_model_len: int
    rng: random.Random  # seeds for requests without one
    max_prompt_chars: int | None = None  # default: max_model_len * PROMPT_CHARS_PER_TOKEN
    allow_special_tokens_in_content: bool = False
    arrivals: Iterator[int] = field(default_factory=itertools.count)
    structured: StructuredDecoding | None = None  # [structured] compiles each request's grammar (thread-safe)
    eos_token_ids: frozenset[int] = frozenset()  # held back, with a request's stop tokens, before its min_tokens

    def __post_init__(self) -> None:
        if self.max_prompt_chars is None:
            self.max_prompt_chars = self.max_model_len * PROMPT_CHARS_PER_TOKEN

    def with_tokenizer(self, tokenizer) -> InputProcessor:
        """The same processor encoding with another tokenizer instance (for another thread);
        the seed draws and arrival numbers stay shared, so one engine keeps one order."""
        return dataclasses.replace(self, tokenizer=tokenizer)

    def process(self, prompt, params: SamplingParams | None, request_id: str) -> Sequence:
        """Validate and tokenize a request; raises InvalidRequestError."""
        params = params or SamplingParams()
        self.check_params(params)
        ids = self.encode(prompt)
        max_tokens = self._resolve_max_tokens(len(ids), params)
        seed = params.seed if params.seed is not None else self.rng.getrandbits(64)
        detokenizer = IncrementalDetokenizer(
            self.output_tokenizer, ids, params.stop, params.skip_special_tokens, params.min_tokens
        )
        # [structured] the grammar compiles (or comes from the cache) here, before admission: a bad one is refused
        constraint = self.structured.constraint_for(params) if self.structured is not None else None
        seq = Sequence(
            request_id, ids, params, next(self.arrivals), seed=seed, max_tokens=max_tokens, detokenizer=detokenizer
        )
        seq.constraint = constraint
        if params.min_tokens:
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            seq.held_ends = sorted(t for t in ends if t < self.vocab_size)
        if params.prediction:
            seq.prediction = Prediction(self._prediction_ids(params.prediction))
        return seq

    def check_params(self, params: SamplingParams) -> None:
        """The limits of SamplingParams that depend on the model."""
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(
                f"top_k must be between 0 and the vocabulary size ({self.vocab_size})", param="top_k"
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids")

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """A string, a list of chat messages, a ChatPrompt or a list of token ids -> token ids, refused
        (InvalidRequestError, param "prompt") when malformed or too long for the context. add_special_tokens: a
        string's, the tokenizer's own (a BOS token, for tokenizers that add one); a chat template writes its own."""
        if isinstance(prompt, str):
            self._check_chars(len(prompt))
            ids = self.tokenizer.encode(_valid_text(prompt), add_special_tokens=add_special_tokens)
        elif _is_chat(prompt):
            ids = self._encode_chat(list(prompt))
        elif isinstance(prompt, ChatPrompt):
            if prompt.add_generation_prompt and prompt.continue_final_message:
                raise InvalidRequestError(
                    "add_generation_prompt and continue_final_message cannot both be true: the one opens a new "
                    "assistant turn, the other continues the last message",
                    param="continue_final_message",
                )
            opening = (prompt.add_generation_prompt, prompt.continue_final_message)
            ids = self._encode_chat(list(prompt.messages), prompt.tools, *opening, prompt.template_kwargs)
        elif isinstance(prompt, (list, tuple)):
            ids = self._token_ids(prompt)
        else:
            raise InvalidRequestError(
                "a prompt must be a string, a list of token ids, or a list of chat messages", param="prompt"
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        self._check_tokens(len(ids))
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (special tokens included), refused like a prompt of token ids when malformed."""
        return self.tokenizer.decode(self._token_ids(token_ids))

    def _encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        generation: bool = True,
        continued: bool = False,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        chars = 0
        if template_kwargs is not None:
            chars += len(check_template_kwargs(template_kwargs, self.tokenizer.special_tokens_map))
            self._check_chars(chars)
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise InvalidRequestError("tools must be a list of tool definitions", param="tools")
            chars += len(_json(tools, "tools"))
            self._check_chars(chars)
        for m in messages:
            if not isinstance(m, dict):
                raise InvalidRequestError("each chat message must be an object", param="prompt")
            role, content = m.get("role"), m.get("content")
            calls = m.get("tool_calls")
            if calls is not None:
                _check_tool_calls(calls)
                chars += len(_json(calls, "prompt"))
                content = "" if content is None else content  # a message of tool calls alone
            if not isinstance(role, str) or not isinstance(content, str):
                raise InvalidRequestError(
                    "each chat message needs a string 'role' and a string 'content'", param="prompt"
                )
            chars += len(role) + len(content) + MESSAGE_OVERHEAD_CHARS
            self._check_chars(chars)
        messages = [{**m, "content": m.get("content") or ""} for m in messages]
        for m in messages:
            _valid_text(m["role"])
            _valid_text(m["content"])
        if tools is not None and not template_calls_tools(self.tokenizer):
            raise InvalidRequestError(
                "this model's chat template does not render tools in the <tool_call> format; send the "
                "conversation as plain messages (the gateway renders tools in its default format)",
                param="tools",
            )
        if not self.tokenizer.chat_template:
            raise InvalidRequestError(
                "this model has no chat template, so it cannot take chat messages; start it with "
                "--chat-template FILE (EngineConfig(chat_template=...)) or send a plain prompt",
                param="prompt",
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                **({"tools": tools} if tools else {}),
                **(template_kwargs or {}),
                add_generation_prompt=generation,
                continue_final_message=continued,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=not self.allow_special_tokens_in_content,
            )
        except Exception as exc:  # noqa: BLE001 - templates raise what they like (jinja errors, ValueError)
            raise InvalidRequestError(
                f"the model's chat template rejected these messages: {exc}", param="prompt"
            ) from exc
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _token_ids(self, prompt: list | tuple) -> list[int]:
        self._check_tokens(len(prompt))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError(
                "a prompt must be a string, a list of token ids, or a list of chat messages", param="prompt"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def _prediction_ids(self, prediction: str | list[int]) -> list[int]:
        """A prediction's tokens (its text's, without special tokens), bounded as a prompt is: no more than the
        context holds."""
        if isinstance(prediction, str):
            self._check_chars(len(prediction), "prediction")
            ids = self.tokenizer.encode(_valid_text(prediction, "prediction"), add_special_tokens=False)
        else:
            ids = prediction
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prediction token ids must be in [0, {self.vocab_size})", param="prediction")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"the prediction has {len(ids)} tokens; this model's context is {self.max_model_len} tokens",
                param="prediction",
            )
        return list(ids)

    def _check_chars(self, chars: int, param: str = "prompt") -> None:
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the {param} has more than {self.max_prompt_chars} characters, more than this model's context of "
                f"{self.max_model_len} tokens can hold",
                param=param,
                code="context_length_exceeded",
            )

    def _check_tokens(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_tokens} tokens; this model's context is {self.max_model_len} tokens, "
                f"so at most {self.max_model_len - 1} prompt tokens leave room for output",
                param="prompt",
                code="context_length_exceeded",
            )

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"this model's context is {self.max_model_len} tokens, but {num_prompt_tokens + params.max_tokens} "
                f"were requested ({num_prompt_tokens} in the prompt, {params.max_tokens} for the completion); "
                "lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return params.max_tokens


def _check_tool_calls(calls) -> None:
    """An assistant message's tool calls, in the shape chat templates read."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), dict)
        for c in calls
    )
    if not ok:
        raise InvalidRequestError(
            "tool_calls must be a list of {'id', 'type': 'function', 'function': {'name': str, 'arguments': dict}}",
            param="prompt",
        )
    for c in calls:
        _valid_text(_json(c, "prompt"))


def _json(value, param: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{param} must be plain JSON data: {exc}", param=param) from None


def _is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _valid_text(text: str, param: str = "prompt") -> str:
    """text, if it can be encoded (a lone surrogate such as "\\ud800" cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(
            f"the {param} holds a lone surrogate, which is not valid Unicode text", param=param
        ) from None
    return text
