"""OpenAI request bodies checked at the edge into typed requests, and OpenAI-shaped errors.

Only what the server honours is read; fields it cannot honour (n > 1, tools) are refused by
name rather than ignored, so a caller never gets an answer to a question it did not ask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # OpenAI's own limit on stop sequences


class ApiError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: the server's default, clipped to the context left
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    speculative: bool = True  # false: a token a step, whatever the server's --speculative


@dataclass(frozen=True)
class GenerationRequest:
    """A chat (`messages`) or plain completion (`prompt`) request, validated."""

    model: str
    chat: bool
    messages: tuple[dict[str, str], ...]  # chat: role and text content of each message
    prompt: str | tuple[int, ...]  # completion: text, or token ids
    sampling: Sampling
    stream: bool
    include_usage: bool


def invalid(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(key, f"{key} must be a number, not {type(value).__name__}", "invalid_type")
    if not low <= value <= high:
        raise invalid(key, f"{key} must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _integer(body: dict, key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(key, f"{key} must be an integer, not {type(value).__name__}", "invalid_type")
    if value < low:
        raise invalid(key, f"{key} must be at least {low}, got {value}")
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(key, f"{key} must be true or false", "invalid_type")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(value) > MAX_STOP:
        raise invalid("stop", f"stop takes at most {MAX_STOP} sequences, got {len(value)}")
    return tuple(s for s in value if s)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""  # an assistant turn that only called tools
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones can go to this model
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(
                    f"messages[{i}].content",
                    "only text content parts are supported by this model",
                )
            if not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content", "a text part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{i}].content", "content must be a string or a list of parts")


def _messages(body: dict) -> tuple[dict[str, str], ...]:
    raw = body.get("messages")
    if raw is None:
        raise invalid("messages", "you must provide a messages parameter", "missing_required")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "each message must be an object", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}")
        out.append({"role": role, "content": _content(m, i)})
    return tuple(out)


def _prompt(body: dict) -> str | tuple[int, ...]:
    raw = body.get("prompt")
    if raw is None:
        raise invalid("prompt", "you must provide a prompt parameter", "missing_required")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(type(t) is int and t >= 0 for t in raw):
        return tuple(raw)
    raise invalid("prompt", "prompt must be a string or a list of token ids (one prompt only)")


def parse_request(body: Any, chat: bool) -> GenerationRequest:
    """The request in `body` (parsed JSON), or ApiError naming the first field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if model is None:
        raise invalid("model", "you must provide a model parameter", "missing_required")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model must be a non-empty string", "invalid_type")
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise invalid("n", f"only n=1 is supported, got {n}", "unsupported_value")
    for key in ("tools", "functions", "logit_bias", "suffix"):
        if body.get(key):
            raise invalid(key, f"{key} is not supported by this server", "unsupported_parameter")
    if body.get("logprobs") not in (None, False, 0):
        raise invalid("logprobs", "logprobs are not supported", "unsupported_parameter")
    if body.get("echo"):
        raise invalid("echo", "echo is not supported", "unsupported_parameter")
    max_tokens = _integer(body, "max_tokens", 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens", 1)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "stream_options must be an object", "invalid_type")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("seed", "seed must be an integer", "invalid_type")
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=None if seed is None else seed % 2**63,
        stop=_stop(body),
        speculative=_flag(body, "speculative") if "speculative" in body else True,
    )
    if sampling.top_p == 0.0:
        raise invalid("top_p", "top_p must be above 0")
    return GenerationRequest(
        model=model,
        chat=chat,
        messages=_messages(body) if chat else (),
        prompt="" if chat else _prompt(body),
        sampling=sampling,
        stream=stream,
        include_usage=bool(options and _flag(options, "include_usage")),
    )
