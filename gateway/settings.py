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

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_n < 1 or self.max_stop < 0:
            raise ValueError("max_body_bytes >= 1024, max_n >= 1 and max_stop >= 0 are required")
        if any(not k for k in self.api_keys):
            raise ValueError("API keys must be non-empty")
