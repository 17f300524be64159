"""The request bodies of `pjinfer serve` (`server.py`), and the checks on their fields.

Request fields: max_tokens (max_completion_tokens for chat), temperature, top_p, top_k, min_p, repeat_penalty, seed
(left out or -1: a random one), stop (a string or a list), ignore_eos (as llama-server: generate past end-of-text
tokens), stream (Server-Sent Events in OpenAI's chunk format, ending with `data: [DONE]`),
stream_options.include_usage. A sampling field that is left out (or null) takes llama-server's default: temperature
0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1 (no penalty); temperature 0 is greedy. A completion's
max_tokens defaults to 16, a chat reply's to what the context leaves, at most 512.

OpenAI fields pjinfer does not implement (logprobs, top_logprobs, echo, suffix, best_of, n, presence_penalty,
frequency_penalty, logit_bias, response_format, tools, tool_choice, functions, function_call, audio, modalities,
prediction) get 400 with `param` naming the field, unless they hold their neutral value (null, false, 0, n = 1,
best_of = 1, {} or [], response_format {"type": "text"}, tool_choice "none"). Fields that change nothing about the
output are accepted and ignored: user, metadata, store, service_tier, parallel_tool_calls. Any other field is
refused with 400 naming it, so a typo (or a llama-server option pjinfer lacks) does not pass silently.
"""
from __future__ import annotations

import json
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

# Sampling fields left unset take llama-server's defaults.
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}

# OpenAI fields pjinfer does not implement, each with the values that ask for nothing (accepted).
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "n": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,),
}
# Fields clients commonly send that change nothing about the output: accepted and ignored.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def _neutral(value, allowed: tuple) -> bool:
    """Whether `value` is one of `allowed`, a bool matching only a bool (False is not 0 here)."""
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


def check_fields(data, known) -> None:
    """Refuses (400, param: the field) an unsupported OpenAI field that asks for something, and a field that is
    neither known, unsupported nor IGNORED. `data` that is not an object is left to validation."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        if name in UNSUPPORTED:
            if not _neutral(value, UNSUPPORTED[name]):
                raise ApiError(400, f"{name} is not supported by this server (got {json.dumps(value)[:80]})",
                               param=name)
        elif name not in known and name not in IGNORED:
            raise ApiError(400, f"unknown field {name!r}", param=name)


# ---------------------------------------------------------------- request bodies
class _Common(BaseModel):
    """Fields of both endpoints; a sampling field left None takes DEFAULT_SAMPLING's value."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    ignore_eos: bool = False       # llama-server's extension: generate past end-of-text tokens


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(None, ge=1)     # None: 16, OpenAI's default


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


def message_text(messages: list[Message]) -> list[dict]:
    """The messages as the chat template takes them: content parts (text only; 400 naming any other part) joined
    with newlines."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if not isinstance(content, str):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise ApiError(400, f"content part of type {part.type!r} is not supported (only text)",
                                   param=f"messages.{i}.content.{j}")
                if part.text is None:
                    raise ApiError(400, "a text part needs its text", param=f"messages.{i}.content.{j}.text")
            content = "\n".join(part.text for part in content)
        out.append({"role": m.role, "content": content})
    return out


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
