"""Request and response shapes (pydantic) and errors: OpenAI-shaped JSON, ``{"error": {"message", "type",
"param", "code"}}``, and the one mapping from library exceptions to HTTP statuses (never a 500 for bad input)."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..compose import ContextOverflow
from ..engines.base import EngineBusy
from ..memory import MemoryInputError
from ..store import StoreError

MAX_BODY_BYTES = 1 << 20


class APIError(Exception):
    """An error answered as OpenAI-style JSON with ``status``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "conflict_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.TYPES.get(self.status, "api_error"),
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
        )


# --- request models --------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=32000)
    name: str | None = None


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    top_k: int | None = Field(None, ge=1, le=200)
    mode: Literal["kv", "prompt", "off"] | None = None
    tail_recompute: int | None = Field(None, ge=0, le=200)
    selective_recompute: int | None = Field(None, ge=0, le=100)  # % of fact tokens; transformers engine only


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields kvmem does not use (logprobs, ...)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: dict | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=1)
    memory: MemoryOptions | None = None


class AddMemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: str | list[dict]
    user_id: str = Field(max_length=256)
    metadata: dict | None = None
    infer: bool = True
    timestamp: float | None = None


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(max_length=8000)
    user_id: str = Field(max_length=256)
    limit: int = Field(10, ge=1, le=1000)
    filters: dict | None = None


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


def error_of(exc: Exception) -> APIError:
    """Library exceptions -> API errors (never a 500 for bad input)."""
    if isinstance(exc, APIError):
        return exc
    if EngineBusy in type(exc).__mro__:
        return APIError(429, f"the engine is busy: {exc}; retry later", "engine_busy")
    if isinstance(exc, ContextOverflow):
        return APIError(400, str(exc), "context_length_exceeded", "messages")
    if isinstance(exc, MemoryInputError):
        msg = str(exc)
        return APIError(404 if "not found" in msg else 400, msg, "memory_not_found" if "not found" in msg else None)
    if isinstance(exc, StoreError):
        return APIError(409, f"the store changed under this request: {exc}", "write_conflict")
    if isinstance(exc, (ValueError, LookupError)):
        return APIError(400, str(exc))
    if isinstance(exc, asyncio.TimeoutError):
        return APIError(503, "the request timed out", "timeout")
    return APIError(500, f"internal error ({type(exc).__name__})", "internal_error")
