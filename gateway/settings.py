"""Gateway settings: one dataclass, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    served_model_name: str | None = None  # None: the engine's model name
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    max_body_bytes: int = 4 * 2**20
    max_n: int = 8
    max_stop: int = 4
    retry_after_seconds: int = 1
    playground: bool = True  # serve the chat page at / and /playground
    # /v1/responses with store: true keeps responses for previous_response_id and GET, per API key:
    # at most this many, this many bytes (oldest dropped first), each for this many seconds.
    response_store_max_count: int = 1000
    response_store_max_bytes: int = 64 * 2**20
    response_store_max_age_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_n < 1 or self.max_stop < 0:
            raise ValueError("max_body_bytes >= 1024, max_n >= 1 and max_stop >= 0 are required")
        if min(self.response_store_max_count, self.response_store_max_bytes, self.response_store_max_age_s) < 0:
            raise ValueError("the response store's limits must be >= 0 (0 stores nothing)")
        if any(not k for k in self.api_keys):
            raise ValueError("API keys must be non-empty")
