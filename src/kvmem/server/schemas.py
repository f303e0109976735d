"""Request and response shapes (pydantic) and errors: OpenAI-shaped JSON, ``{"error": {"message", "type",
"param", "code"}}``, and the one mapping from library exceptions to HTTP statuses (never a 500 for bad input)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..compose import ContextOverflow
from ..engines.base import EngineBusy
from ..memory import MemoryInputError
from ..store import StoreBusy, StoreError, StoreUnavailable
from ..store import redact_text as _redact_text

logger = logging.getLogger("kvmem.server")


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
        507: "insufficient_storage",
    }

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        if self.status != 422:  # where mem0ai's client reads a message; a 422's "detail" is FastAPI's list
            body["detail"] = self.message
        return JSONResponse(body, status_code=self.status)


# --- error bodies, as OpenAPI lists them --------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error's body: OpenAI's ``error`` object, and ``detail`` (its message; absent on a 422)."""

    error: ErrorDetail
    detail: str | None = None


ERROR_MEANINGS = {
    400: "bad input (malformed JSON, a bad id or filter, context overflow, an unsupported field)",
    401: "missing or unknown API key",
    403: "another tenant's memory",
    404: "unknown memory id, model or route",
    409: "a write that lost a race with another writer",
    413: "body over --max-body-bytes, or without Content-Length",
    422: "a field of the wrong type or out of range",
    429: "the engine's or the writes' queue is full; retry later",
    503: "not ready, timed out, the engine died, or the store is busy or unreachable; retry later",
    507: "no space left on the store's disk; nothing was written",
}


def error_responses(*statuses: int) -> dict:
    """FastAPI ``responses`` for ``statuses``: each an ``ErrorBody`` (so the OpenAPI document lists them)."""
    return {s: {"model": ErrorBody, "description": ERROR_MEANINGS[s]} for s in statuses}


# --- request models --------------------------------------------------------------------------------------


def _check_no_nul(data):
    """Refuses a NUL character in any string of a request body (PostgreSQL cannot store one, so no
    store takes them), found without recursion. Raises PydanticCustomError ``nul_character`` (HTTP 400 naming it)."""
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            if "\x00" in x:
                raise PydanticCustomError("nul_character", "NUL characters (\\u0000) are not allowed")
        elif isinstance(x, dict):
            todo += list(x.keys()) + list(x.values())
        elif isinstance(x, list):
            todo += x
    return data


class Body(BaseModel):
    """A request body's model: no NUL character in any of its strings."""

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data):
        return _check_no_nul(data)


def bad_request(reason: str) -> PydanticCustomError:
    """A validation error answered 400 (not 422) naming the field where it arose (``routes``)."""
    return PydanticCustomError("bad_request", "{reason}", {"reason": reason})


MAX_TOOLS = 128  # tools per request
MAX_STOPS = 4  # stop strings per chat, as OpenAI's
NonEmpty = Annotated[str, Field(min_length=1)]  # an empty string is a 400 (``routes``: string_too_short)
NONBLANK = r"\S"  # a string with a character other than whitespace (else 400, ``routes``)
MAX_TOOLS_BYTES = 32 << 10  # the tools block as JSON text: it is rendered into every prompt of the chat


def _local_refs_only(schema) -> None:
    """Raises ``bad_request`` for a ``$ref`` that points outside the schema (nothing is fetched, ever)."""
    todo = [schema]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            ref = x.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                raise bad_request(f"only local '$ref's (starting with '#') are allowed, not {str(ref)[:80]!r}")
            todo += list(x.values())
        elif isinstance(x, list):
            todo += x


def check_json_schema(schema: dict) -> dict:
    """``schema`` if it is a valid JSON Schema (its own meta-schema, the ``jsonschema`` library: 2020-12 unless
    ``$schema`` names another draft) describing an object, with local ``$ref``s only; else ``bad_request``."""
    import jsonschema
    from jsonschema.validators import validator_for

    _local_refs_only(schema)
    if not isinstance(schema.get("$schema", ""), str):
        raise bad_request("'$schema' must be a string (a JSON Schema draft's URI)")
    try:
        validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(x) for x in exc.absolute_path)
        raise bad_request(f"not a valid JSON Schema at '{where}': {exc.message[:200]}") from None
    except Exception as exc:  # the checker failing on input it did not expect is still bad input, never a 500
        raise bad_request(f"not a valid JSON Schema ({type(exc).__name__})") from None
    if schema.get("type", "object") != "object":
        raise bad_request("a tool's parameters must describe a JSON object ('type': 'object')")
    return schema


class ToolFunction(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8000)
    parameters: dict | None = None  # JSON Schema of the arguments object; None: no arguments
    strict: bool | None = None  # arguments always match the schema under tool_choice required or named

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v):
        return None if v is None else check_json_schema(v)

    def schema(self) -> dict:
        """The arguments' JSON Schema (an object without properties when none was given)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    """OpenAI's ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"]
    function: ToolFunction


class NamedFunction(BaseModel):
    name: str = Field(max_length=64)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the answer is one call of it."""

    type: Literal["function"]
    function: NamedFunction


class TextPart(BaseModel):
    type: Literal["text"]
    text: str = Field(max_length=32000)


class FunctionCall(BaseModel):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=32000)  # JSON text of an object, as OpenAI sends it


class ToolCall(BaseModel):
    """A call the assistant made, in a history: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: newer clients' system role
    # None: only an assistant message that carries tool_calls
    content: str | list[TextPart | dict] | None = Field(None, max_length=32000)
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant messages only
    tool_call_id: str | None = Field(None, max_length=128)  # tool messages only: the call this answers

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request("only an assistant message may carry 'tool_calls'")
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a tool message needs the 'tool_call_id' of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise bad_request("only a tool message may carry 'tool_call_id'")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_request(f"a {self.role} message needs 'content' (null only beside 'tool_calls')")
        for call in self.tool_calls or []:
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise bad_request(f"tool call {call.id!r}: 'arguments' must be the JSON text of an object")
        return self

    def text(self) -> str:
        """The message's text: a string, or its text parts joined ("" for an assistant's calls without text).
        Raises APIError 400 for other parts (images, audio, files: this server's models read text only)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if not isinstance(p, TextPart):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise APIError(
                    400,
                    f"content parts of type {str(kind)[:40]!r} are not supported: text only",
                    "unsupported_content",
                    "messages",
                )
            parts.append(p.text)
        text = "".join(parts)
        if len(text) > 32000:
            raise APIError(400, "a message's text is over 32000 characters", "invalid_value", "messages")
        return text

    @property
    def chat_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    def for_template(self) -> dict:
        """The message as chat templates take it (``compose.PromptFormat``): role and text; an assistant's
        ``tool_calls`` with ``arguments`` as an object; a tool result's ``tool_call_id``."""
        out = {"role": self.chat_role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


# OpenAI fields that change the response and that this server does not implement: refused, never ignored.
UNSUPPORTED_FIELDS = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
)
# Sampling hints that change only the distribution; accepted and ignored (docs/server.md).
IGNORED_FIELDS = (
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
)


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    top_k: int | None = Field(None, ge=1, le=200)
    mode: Literal["kv", "prompt", "off"] | None = None
    tail_recompute: int | None = Field(None, ge=0, le=200)
    selective_recompute: int | None = Field(None, ge=0, le=100)  # % of fact tokens; transformers engine only
    agent_id: str | None = Field(None, max_length=256)  # with the chat's user: the scopes memory comes from
    run_id: str | None = Field(None, max_length=256)
    # "cold" (load tests): this request's memory is read from the store, every cache tier dropped first
    cache: Literal["default", "cold"] | None = None


class JSONSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching ``json_schema.schema``
    (guided decoding: vLLM's structured outputs, xgrammar on the transformers engine)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def schema_json(self) -> str | None:
        """The schema to decode under, as JSON text; None for plain text. Raises APIError 400."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.json_schema is None:
            raise APIError(400, "response_format: type 'json_schema' needs 'json_schema'", param="response_format")
        return json.dumps(self.json_schema.schema_, sort_keys=True)


class ChatRequest(Body):
    model_config = ConfigDict(extra="allow")  # checked: UNSUPPORTED_FIELDS refused, IGNORED_FIELDS ignored
    model: str | None = None
    messages: list[ChatMessage] = Field(
        min_length=1, max_length=256, description="The last message is the user's or a tool's (else 400)."
    )
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: dict | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    memory: MemoryOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None  # false: at most one call per answer

    @field_validator("messages")
    @classmethod
    def _tool_results_follow_calls(cls, messages: list[ChatMessage]):
        """Each tool message answers a call (by ``tool_call_id``) that an earlier assistant message made; the
        last message is the user's or a tool's (the one to answer)."""
        calls: set[str] = set()
        for i, m in enumerate(messages):
            calls.update(c.id for c in m.tool_calls or [])
            if m.role == "tool" and m.tool_call_id not in calls:
                raise bad_request(f"messages[{i}]: no earlier assistant tool call has id {m.tool_call_id!r}")
        if messages and messages[-1].role not in ("user", "tool"):
            raise bad_request("the last message must be from the user or a tool")
        return messages

    def stops(self) -> list[str]:
        """The stop strings (``stop``: one or a list), checked by the field: non-empty, at most ``MAX_STOPS``."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("tools")
    @classmethod
    def _tools_bounded(cls, tools: list[Tool] | None):
        if not tools:
            return None
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"at most {MAX_TOOLS} tools per request, not {len(tools)}")
        size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False).encode())
        if size > MAX_TOOLS_BYTES:
            raise bad_request(f"the tools take {size} bytes as JSON; at most {MAX_TOOLS_BYTES}")
        names = [t.function.name for t in tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise bad_request(f"two tools are named {dup!r}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, choice, info: ValidationInfo):
        if "tools" not in info.data:  # the tools failed their own checks: that error is the one answered
            return choice
        tools = info.data["tools"] or []
        if choice is None or choice in ("none", "auto"):
            return choice
        if not tools:
            raise bad_request("tool_choice other than 'none' or 'auto' needs 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in 'tools'")
        return choice

    def tool_mode(self) -> str:
        """How the answer may use the tools: "none" (text only; no tools, or tool_choice none), "auto" (text
        or calls, the model's choice), "required" (one call of any tool) or "named" (one call of the named)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None or self.tool_choice == "auto":
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    def check_supported(self) -> None:
        """APIError 400 naming the first field set that this server would otherwise silently ignore."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            value = extra.get(name)
            if value is None or value is False or value in ([], {}):
                continue
            if name == "tool_choice" and value == "none":
                continue
            raise APIError(400, f"'{name}' is not supported by this server", "unsupported_parameter", name)
        if self.n > 1:
            raise APIError(400, "'n' > 1 is not supported by this server: one choice per request", param="n")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")


class Scoped(Body):
    """Entity ids (Mem0's scopes) at the top level or inside ``filters``; ``app_id`` is refused (no app scope)."""

    model_config = ConfigDict(extra="forbid")
    user_id: NonEmpty | int | None = None
    agent_id: NonEmpty | int | None = None
    run_id: NonEmpty | int | None = None
    app_id: None = Field(None, description="Not supported: kvmem has no app scope (400).")
    filters: dict | None = None

    @field_validator("app_id", mode="before")
    @classmethod
    def _no_app(cls, app_id):
        if app_id is not None:
            raise bad_request("app_id is not supported: scope memories by user_id, agent_id or run_id")
        return app_id

    def ids(self) -> dict:
        if "app_id" in (self.filters or {}):
            raise APIError(
                400, "app_id is not supported: scope memories by user_id, agent_id or run_id", param="app_id"
            )
        return {"user_id": self.user_id, "agent_id": self.agent_id, "run_id": self.run_id}

    def scope_ids(self) -> dict:
        """The ids of an add (top level, else in ``filters``, as mem0ai's client may send them)."""
        ids, f = self.ids(), self.filters or {}
        unknown = set(f) - {"user_id", "agent_id", "run_id"}
        if unknown:
            raise APIError(400, f"an add's filters hold entity ids only, not {sorted(unknown)}", param="filters")
        for k, v in f.items():
            if ids[k] is not None and str(ids[k]) != str(v):
                raise APIError(400, f"conflicting scopes: {k}={ids[k]!r} and filters[{k!r}]={v!r}", param=k)
            ids[k] = v
        return ids


class AddMemoryRequest(Scoped):
    messages: str | dict | list[dict]
    metadata: dict | None = None
    infer: bool = True
    timestamp: float | None = None
    expiration_date: str | None = None
    custom_instructions: str | None = Field(None, max_length=8000)
    prompt: str | None = Field(None, max_length=8000, description="Not with custom_instructions (400).")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt, info: ValidationInfo):
        if prompt is not None and info.data.get("custom_instructions") is not None:
            raise bad_request("give prompt or custom_instructions, not both")
        return prompt


class SearchRequest(Scoped):
    query: str = Field(max_length=8000, pattern=NONBLANK)
    limit: int | None = Field(None, ge=1, le=1000)
    top_k: int | None = Field(None, ge=0, le=1000)
    threshold: float | None = Field(None, ge=0, le=1)
    show_expired: bool = False
    rerank: bool = Field(False, json_schema_extra={"const": False})  # kvmem does not rerank (400)
    keyword_search: bool | None = None  # None: the server's --hybrid; True: cosine fused with keyword scores
    explain: bool = False  # each result's score_details: semantic and keyword parts
    latest_only: bool | None = None  # every memory is its latest version here (an update keeps its id)

    @field_validator("rerank")
    @classmethod
    def _no_rerank(cls, rerank: bool):
        if rerank:
            raise bad_request("rerank is not supported: kvmem ranks by cosine, or fused with keywords")
        return rerank


class ListRequest(Scoped):
    show_expired: bool = False
    latest_only: bool | None = None


class UpdateRequest(Body):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})
    text: str | None = None
    metadata: dict | None = None
    expiration_date: str | None = None

    @model_validator(mode="after")
    def _something(self):
        if not self.model_fields_set:
            raise bad_request("At least one of text, metadata, or expiration_date must be provided.")
        return self


def engine_dead() -> APIError:
    """503 ``engine_dead``: the engine's process has died and the server is draining before it exits."""
    return APIError(503, "the engine has died; this server is shutting down", "engine_dead")


def redact_text(text: str) -> str:
    """``text`` with the credentials of every URL in it removed (``store.redact_text``), for the server's log."""
    return _redact_text(text)


_LOGGED = [0.0]  # when a store outage was last logged (once per STORE_LOG_EVERY_S: a stall fails every request)
STORE_LOG_EVERY_S = 10.0


def store_unavailable(exc: Exception | None = None) -> APIError:
    """503 ``store_unavailable``: the store's database does not answer (down, stalled, cut off). The body names no
    URL and no database error; the cause goes to the log, at most once per ``STORE_LOG_EVERY_S``."""
    now = time.monotonic()
    if exc is not None and now - _LOGGED[0] >= STORE_LOG_EVERY_S:
        _LOGGED[0] = now
        logger.warning("the store cannot be reached: %s", redact_text(str(exc)))
    return APIError(503, "the store cannot be reached; retry later", "store_unavailable")


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
        if "not found" in msg:
            return APIError(404, msg, "memory_not_found")
        return APIError(400, msg, param=getattr(exc, "param", None))
    # the store's own words name its location (a path, a PostgreSQL URL) and quote the database: logged here,
    # never sent to the client
    if isinstance(exc, StoreBusy):
        logger.warning("store busy: %s", redact_text(str(exc)))
        return APIError(503, "the store is busy (another writer holds its lock); retry later", "store_busy")
    if isinstance(exc, StoreUnavailable):
        return store_unavailable(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        logger.error("no space left on the store's disk: %s", exc)
        return APIError(507, "no space left on the store's disk; nothing was written", "insufficient_storage")
    if isinstance(exc, StoreError):
        logger.warning("a store error answered 409: %s", redact_text(str(exc)))
        return APIError(409, "the store changed under this request; read again and retry", "write_conflict")
    if isinstance(exc, (ValueError, LookupError)):
        return APIError(400, str(exc))
    if isinstance(exc, asyncio.TimeoutError):
        return APIError(503, "the request timed out", "timeout")
    return APIError(500, f"internal error ({type(exc).__name__})", "internal_error")
