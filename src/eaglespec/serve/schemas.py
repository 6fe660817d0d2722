"""Request models of the OpenAI-compatible API, and the OpenAI error JSON shape.

Requests are parsed strictly: a JSON type that does not match (`"max_tokens": "5"`, `"stream": 1`) is an error,
and a parameter we do not implement is refused by name instead of being silently ignored. A few OpenAI
parameters are accepted only with the value that asks for what we always do (`presence_penalty: 0`,
`logprobs: false`, `echo: false`, ...), so clients that send their defaults explicitly keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 4  # as in the OpenAI API


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """OpenAI also allows content as a list of parts; we take text parts only."""
        if isinstance(value, list):
            texts = []
            for part in value:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                        and set(part) <= {"type", "text"}):
                    raise ValueError('only text content parts ({"type": "text", "text": "..."}) are supported')
                texts.append(part["text"])
            return "".join(texts)
        return value

    def as_template_message(self) -> dict[str, str]:
        # "developer" is OpenAI's newer name for the system role.
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class _SamplingRequest(_Strict):
    """Parameters common to both endpoints."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # extension (as in vLLM): 0 = off
    stop: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted only with their neutral value (what we always do).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return value
        if isinstance(value, str):
            return [value]
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0.0):
            raise ValueError(f"penalties are not supported; only 0 is accepted, got {value}")
        return value

    @model_validator(mode="after")
    def _options_need_stream(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported; only false is accepted")
        return value

    @model_validator(mode="after")
    def _one_limit(self) -> "ChatCompletionRequest":
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_tokens and max_completion_tokens disagree; send only one of them")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A string, a list holding one string, or a list of token ids (one prompt per request)."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        elif isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            raise ValueError(f"only one prompt per request is supported, got {len(value)}")
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(v) is int for v in value):
            return value
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        raise ValueError("prompt must be a string, a list with one string, or a list of token ids")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; only false is accepted")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {value}")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("logprobs are not supported; only null is accepted")
        return value


def parse_request(model: type[_SamplingRequest], body: bytes) -> Any:
    """Validate a raw JSON body; raise `APIError` (400) with a message naming the offending parameter."""
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def _param_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = str(part)
        else:
            path += f".{part}"
    return path


def _to_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind, loc, msg = first["type"], tuple(first["loc"]), first["msg"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", msg)
        return APIError(400, f"The request body is not valid JSON ({detail}).", code="invalid_json")
    if kind == "model_type" and not loc:
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    param = _param_path(loc)
    if kind == "extra_forbidden":
        return APIError(400, f"Unsupported parameter: '{param}' is not supported by this server.", param=param,
                        code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "value_error":  # our own checks: the message already says what was wrong
        msg = msg.removeprefix("Value error, ")
        if not param:  # a check across several parameters (model_validator)
            return APIError(400, f"Invalid request: {msg}.", code="invalid_value")
        return APIError(400, f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    return APIError(400, f"Invalid value for '{param}': {msg} (got {shown}).", param=param, code="invalid_value")
