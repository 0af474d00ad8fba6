"""Request schemas of the OpenAI API subset we serve, and their translation into the
engine's SamplingParams. Validation is strict: wrong types, NaN/inf, out-of-range values
and unknown fields are 400s; features we do not implement are named in the error."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import APIError
from specstream import SamplingParams

# Static bounds, checked before anything reaches the engine (which also checks top_k against
# its vocabulary, and prompt + max_tokens against its context).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_K = 2**20  # above any real vocabulary (the largest are about 2**18)
MAX_TOKENS = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]

# Fields of the OpenAI API that this server does not implement: a request using one gets a
# 400 naming it (a falsy value, e.g. tools=[], is accepted as "not used").
UNSUPPORTED = {
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "functions": "function calling",
    "function_call": "function calling",
    "parallel_tool_calls": "tool calling",
    "logit_bias": "logit_bias",
    "audio": "audio output",
    "prediction": "predicted outputs",
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
    method: Literal["auto", "eagle", "ngram", "draft", "off"] | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=64)


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
    ignore_eos: bool = False
    speculative: SpeculativeOptions | Literal["off"] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # OpenAI's prompt caching routing hint: a load balancer may route on it (deploy/nginx.conf).
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    # Known but unsupported: typed loosely so the error can name the feature.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    logit_bias: Any = None
    audio: Any = None
    prediction: Any = None
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

    def sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, seed_offset: int, engine_method: str
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=None if self.seed is None else _wrap_int64(self.seed + seed_offset),
            stop=self.stops,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            num_speculative_tokens=self.speculation_cap(engine_method),
            cache_salt=self.cache_salt,
        )


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    refusal: Any = None

    def text(self, index: int) -> str:
        where = f"messages[{index}]"
        if self.role in ("tool", "function") or self.tool_calls or self.tool_call_id:
            raise APIError(
                400,
                f"{where}: tool messages are not supported by this server",
                param=where,
                code="unsupported_parameter",
            )
        if self.content is None:
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
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(
                400,
                "response_format other than {'type': 'text'} is not supported",
                param="response_format",
                code="unsupported_parameter",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")

    def chat_messages(self) -> list[dict]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            for i, m in enumerate(self.messages)
        ]

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
