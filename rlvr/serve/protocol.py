"""The OpenAI requests `rlvr serve` accepts, validated as carefully as the config.

A top-level field the server does not know is refused (400, naming it) rather than silently
ignored, except the handful that OpenAI clients and agent frameworks send by default and that
change nothing here (`IGNORED`), which are accepted and ignored; inside messages, fields other
clients echo back (`refusal`, `annotations`, …) are ignored. A null for any field means its
default, as OpenAI takes it. Types are strict: `"1"` is not a number, `true` is not an integer. Limits on what one request may ask (`n`, `max_tokens`, stop strings)
come from `Limits`, so an over-limit request is a 400 naming the field, never an exhausted
machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, and how many may run at once."""

    max_n: int = 16
    """Completions per request (`n`) at most."""
    max_tokens: int = 2048
    """`max_tokens` / `max_completion_tokens` at most; also the default when a request sets neither
    (less where the model's context leaves less room)."""
    max_body_bytes: int = 2 * 2**20
    """Request body size at most (413 above it)."""
    max_concurrent: int = 64
    """Requests being served at once at most (429 above it); each waits for the engine in turn, and
    those that arrive together are sampled in one batch."""
    max_stop: int = 8
    """Stop strings per request at most."""
    max_top_logprobs: int = 20
    """`top_logprobs` at most (OpenAI's own limit)."""


# Sent by OpenAI clients and agent frameworks by default; nothing here depends on them.
IGNORED = frozenset({"user", "store", "metadata", "parallel_tool_calls", "service_tier", "return_token_ids",
                     "prompt_cache_key", "safety_identifier"})

SEED_RANGE = (-(2**63), 2**63 - 1)
"""What `seed` may be (a 64-bit integer, as torch's generators take it)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):  # null means the default (OpenAI's clients send explicit nulls)
            return {k: v for k, v in data.items() if k not in IGNORED and v is not None}
        return data


class ToolFunction(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: ToolFunction


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. `refusal`, `annotations` echoed back by clients
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallSpec] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            other = [p.get("type") for p in v if isinstance(p, dict) and p.get("type") != "text"]
            if other:
                raise ValueError(f"only text content parts are served, not {other[0]!r}")
        return v

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Sampling(_Strict):
    """The sampling fields both endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # vLLM's extension: 0 (or -1) = all
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @field_validator("top_k", mode="before")
    @classmethod
    def _minus_one_is_all(cls, v: Any) -> Any:
        return 0 if v == -1 else v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0:  # a penalised distribution is not the policy's: its log-probs would mislead a trainer
            raise ValueError("penalties are not supported (the samples must come from the policy itself); use 0")
        return v

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        return tuple(stop)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None

    def check(self) -> None:
        """The checks that span fields (each names the field to fix)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise Invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if isinstance(self.tool_choice, dict):
            raise Invalid('only "auto" and "none" are supported (forcing a call would need constrained decoding, '
                          "which would change the policy's samples)", "tool_choice")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise Invalid("max_tokens and max_completion_tokens disagree; set one", "max_completion_tokens")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """POST /v1/completions: a prompt as text or as token ids (one prompt per request)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        """The checks that span fields (each names the field to fix)."""
        if self.echo:
            raise Invalid("echo is not supported", "echo")
        if self.suffix:
            raise Invalid("suffix is not supported", "suffix")
        if self.best_of not in (None, self.n):
            raise Invalid("best_of is not supported (it would return a selection, not the policy's samples)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a list of strings or of token lists is a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)  # type: ignore[arg-type]

    def token_limit(self) -> int | None:
        return self.max_tokens


class Invalid(ValueError):
    """A request the server cannot serve as asked: a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def utf8(text: str, param: str) -> str:
    """The text, if it can be encoded (JSON can carry lone surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Invalid(f"{param} is not valid Unicode ({e.reason} at position {e.start})", param) from e
    return text


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error layout, which its clients turn into typed exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
