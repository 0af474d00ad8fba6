"""Request schemas of the OpenAI API subset we serve, and their translation into the
engine's SamplingParams. Validation is strict: wrong types, NaN/inf, out-of-range values
and unknown fields are 400s; features we do not implement are named in the error."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway import tools as tool_format
from gateway.body import parse_json_object
from gateway.errors import APIError
from specstream import ChatPrompt, SamplingParams, StructuredOutput

# Static bounds, checked before anything reaches the engine (which also checks top_k against
# its vocabulary, and prompt + max_tokens against its context).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_K = 2**20  # above any real vocabulary (the largest are about 2**18)
MAX_TOKENS = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]

# Fields of the OpenAI API that this server does not implement: a request using one gets a
# 400 naming it (a falsy value, e.g. tools=[], is accepted as "not used").
UNSUPPORTED = {
    "functions": "function calling (the legacy API; use tools)",
    "function_call": "function calling (the legacy API; use tool_choice)",
    "audio": "audio output",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning_effort",
    "store": "stored completions",
    "metadata": "stored completions metadata",
    "service_tier": "service_tier",
    "suffix": "suffix",
    "echo": "echo",
}


def _wrap_int64(value: int) -> int:
    """Seeds of the n choices are seed, seed + 1, ...: wrapped so each stays an int64."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculativeOptions(_Strict):
    method: Literal["auto", "suffix", "eagle", "ngram", "draft", "off"] | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=64)


class PredictionText(_Strict):
    type: Literal["text"]
    text: str


class PredictedContent(_Strict):
    """OpenAI's predicted outputs: text the answer is expected to contain (a file to be edited), drafted where the
    answer follows it; it changes how fast the answer comes, never what it says."""

    type: Literal["content"]
    content: str | list[PredictionText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _SamplingFields(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=1024)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM-style extras (through extra_body)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    ignore_eos: bool = False
    speculative: SpeculativeOptions | Literal["off"] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # OpenAI's prompt caching routing hint: a load balancer may route on it (deploy/nginx.conf).
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prediction: PredictedContent | None = None
    # OpenAI's stable end-user id for abuse monitoring (the successor of `user`): accepted, not used, as `user` is
    safety_identifier: str | None = Field(default=None, max_length=256)
    # [structured] logit_bias (bounds checked by SamplingParams) and vLLM's guided decoding extras
    logit_bias: dict[str, float] | None = None
    guided_json: dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Known but unsupported: typed loosely so the error can name the feature.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    modalities: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_supported(self) -> None:
        for name, feature in UNSUPPORTED.items():
            if getattr(self, name, None):
                raise APIError(
                    400,
                    f"{feature} is not supported by this server ('{name}')",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.modalities and set(self.modalities) != {"text"}:
            raise APIError(
                400, "only the 'text' modality is supported", param="modalities", code="unsupported_parameter"
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def speculation_cap(self, engine_method: str) -> int | None:
        """The request's num_speculative_tokens for the engine: None = server default, 0 = off."""
        spec = self.speculative
        if spec is None:
            return None
        if spec == "off" or spec.method == "off":
            return 0
        if spec.method is not None and spec.method != engine_method:
            raise APIError(
                400,
                f"this server runs '{engine_method}' speculation; a request may use it or 'off', not '{spec.method}'",
                param="speculative.method",
            )
        return spec.num_speculative_tokens

    def structured(self) -> StructuredOutput | None:
        """[structured] The grammar this request asks for (vLLM's guided_* extras here;
        response_format and tools on chat requests)."""
        given = {
            "guided_json": {"json_schema": self.guided_json},
            "guided_regex": {"regex": self.guided_regex},
            "guided_choice": {"choice": self.guided_choice},
            "guided_grammar": {"grammar": self.guided_grammar},
        }
        used = [name for name in given if getattr(self, name) is not None]
        if len(used) > 1:
            raise APIError(400, f"use at most one of {', '.join(used)}", param=used[1])
        return StructuredOutput(**given[used[0]], param=used[0]) if used else None

    def sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, seed_offset: int, engine_method: str
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            seed=None if self.seed is None else _wrap_int64(self.seed + seed_offset),
            stop=self.stops,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            num_speculative_tokens=self.speculation_cap(engine_method),
            cache_salt=self.cache_salt,
            structured=self.structured(),  # [structured]
            logit_bias=self.logit_bias,  # [structured]
            prediction=self.prediction.text() if self.prediction is not None else None,
        )


class FunctionCall(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    arguments: str


class ToolCallMessage(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    refusal: Any = None

    def text(self, index: int) -> str:
        where = f"messages[{index}]"
        if self.role == "function":
            raise APIError(
                400,
                f"{where}: 'function' messages (the legacy API) are not supported; use 'tool'",
                param=where,
                code="unsupported_parameter",
            )
        if self.tool_calls and self.role != "assistant":
            raise APIError(400, f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise APIError(400, f"{where}: a tool message needs tool_call_id", param=f"{where}.tool_call_id")
        if self.content is None:
            if self.tool_calls:
                return ""
            raise APIError(400, f"{where}: content is required", param=f"{where}.content")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
                parts.append(part["text"])
            elif kind in ("image_url", "input_image", "input_audio", "file", "audio"):
                raise APIError(
                    400,
                    f"{where}: {kind} content is not supported by this server (text only)",
                    param=f"{where}.content[{j}]",
                    code="unsupported_parameter",
                )
            else:
                raise APIError(
                    400, f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}", param=f"{where}.content[{j}]"
                )
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # [structured] response_format and tools
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the model's chat template (e.g. {"enable_thinking": false}); checked by the
    # engine's processor (check_template_kwargs), which bounds them with the prompt
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        # [structured]
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tool function names must be unique", param="tools")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names '{self.tool_choice.function.name}', which is not in tools",
                param="tool_choice.function.name",
            )
        fmt = self.response_format
        if (
            fmt is not None
            and fmt.type == "json_schema"
            and (fmt.json_schema is None or fmt.json_schema.schema_ is None)
        ):
            raise APIError(
                400, "response_format json_schema needs json_schema.schema", param="response_format.json_schema"
            )
        grammars = [
            n
            for n in ("response_format", "tools", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if self._constrains(n)
        ]
        if len(grammars) > 1:
            raise APIError(400, f"{grammars[0]} and {grammars[1]} cannot be combined", param=grammars[1])

    def _constrains(self, name: str) -> bool:
        if name == "response_format":
            return self.response_format is not None and self.response_format.type != "text"
        if name == "tools":
            return self.tool_mode is not None
        return getattr(self, name) is not None

    @property
    def tool_mode(self):
        """[structured] None (no tools in play), "auto", "required", or a NamedToolChoice."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tool_choice or "auto"

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def structured(self) -> StructuredOutput | None:
        """[structured] response_format or tools (or a guided_* extra) as a grammar."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutput(json_object=True, param="response_format")
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutput(json_schema=fmt.json_schema.schema_, param="response_format.json_schema.schema")
        if self.tool_mode is not None:
            choice = self.tool_mode if isinstance(self.tool_mode, str) else self.tool_mode.model_dump()
            return tool_format.tool_grammar(self.tool_dicts(), choice, self.parallel_tool_calls)
        return super().structured()

    def chat_messages(self, template_calls_tools: bool = False) -> list[dict] | ChatPrompt:
        """The conversation for the engine. With tools in play (definitions offered, or earlier tool
        calls and results in the messages) and a chat template that renders tools itself in the
        <tool_call> format (template_calls_tools), a ChatPrompt for the template; else plain messages,
        tools rendered in gateway/tools.py's default format. With chat_template_kwargs, a ChatPrompt either way."""
        prompt = self._conversation(template_calls_tools)
        if self.chat_template_kwargs is None:
            return prompt
        if isinstance(prompt, ChatPrompt):
            return replace(prompt, template_kwargs=self.chat_template_kwargs)
        return ChatPrompt(prompt, template_kwargs=self.chat_template_kwargs)

    def _conversation(self, template_calls_tools: bool) -> list[dict] | ChatPrompt:
        messages = []
        for i, m in enumerate(self.messages):
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        if not any("tool_calls" in m or m["role"] == "tool" for m in messages) and self.tool_mode is None:
            return messages
        if template_calls_tools:  # [structured] the template's own tool format
            for i, m in enumerate(messages):
                for j, call in enumerate(m.get("tool_calls", ())):
                    call["function"]["arguments"] = _arguments_object(
                        call["function"]["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments"
                    )
            tools = self.tool_dicts() if self.tool_mode is not None else None
            return ChatPrompt(messages, tools)
        return tool_format.render_messages(messages, self.tool_dicts(), self.tool_choice)  # [structured]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1, le=1024)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                400, "best_of is not supported by this server", param="best_of", code="unsupported_parameter"
            )

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


def parse(model: type[BaseModel], data: Any):
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    # OpenAI's schema lets optional fields be null: null means "not given".
    data = {k: v for k, v in data.items() if v is not None}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])[:100]
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {loc}", param=loc) from None
        raise APIError(400, f"Invalid value for '{loc}': {err['msg']}", param=loc) from None


def _arguments_object(arguments: str, where: str) -> dict:
    """A tool call's arguments (a JSON string in OpenAI's API) as the object chat templates render,
    parsed as strictly as a request body (no NaN or Infinity; nesting too deep is a 400, not a 500)."""
    try:
        return parse_json_object(arguments.encode("utf-8"))
    except (APIError, UnicodeEncodeError):
        raise APIError(400, f"{where} must be a JSON object (as a string)", param=where) from None
