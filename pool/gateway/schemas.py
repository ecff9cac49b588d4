"""OpenAI request bodies (pydantic, strict types) and the response and chunk shapes the gateway writes.

Bodies accept unknown fields (clients send many); the ones the engine
understands beyond OpenAI's set - `top_k`, `ignore_eos`,
`repetition_penalty`, `stop_token_ids`, `seed` - are declared here so they
reach `SamplingParams`, as in vLLM. Types are strict, except where vLLM's
lax parsing is what clients rely on: a numeric string for a token count
(`"max_tokens": "10"`) is taken as vLLM takes it. `seed` is a signed 64-bit
integer, as vLLM's. Responses are plain dicts built here: one place knows the
wire format.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = Field(default=False, description="Send a last chunk with `usage` and no choices.")


class _Generation(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(description="A served model id (GET /v1/models).")
    max_tokens: int | None = Field(default=None, ge=1, strict=False, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 = greedy; default 1.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus mass kept; default 1.")
    top_k: int | None = Field(default=None, ge=-1, description="Keep the k likeliest tokens; 0 or -1 = off.")
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX, description="Same seed, same tokens.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings (not returned).")
    stop_token_ids: list[int] | None = Field(default=None, description="Token ids that end the output.")
    ignore_eos: bool | None = Field(default=False, description="Keep going past the end-of-sequence token.")
    repetition_penalty: float | None = Field(default=None, gt=0, description="HF semantics; 1 = off.")
    stream: bool | None = Field(default=False, description="Stream tokens as server-sent events.")
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, description="Choices per request; only 1 is supported.")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(default=None, description="Not supported (must be empty).")
    user: str | None = None


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text or token ids; a list of several prompts is not supported.")
    echo: bool | None = Field(default=False, description="Not supported.")
    logprobs: int | None = Field(default=None, description="Not supported.")
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    suffix: str | None = Field(default=None, description="Not supported.")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=False,
                                              description="Preferred over max_tokens.")
    logprobs: bool | None = Field(default=False, description="Not supported.")
    top_logprobs: int | None = Field(default=None, description="Not supported.")
    tools: list[Any] | None = Field(default=None, description="Not supported.")
    response_format: dict[str, Any] | None = Field(default=None, description="Only {'type': 'text'}.")
    add_generation_prompt: bool | None = Field(default=True, description="Chat template option.")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="Extra chat template variables.")
    chat_template: str | None = Field(default=None, description="A chat template to use instead of the model's; "
                                      "refused unless the server trusts request templates.")


# ---- responses ----------------------------------------------------------------------------------
Kind = Literal["completion", "chat"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, root: str, max_model_len: int, owned_by: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": owned_by, "root": root,
            "parent": None, "max_model_len": max_model_len, "permission": []}


class ResponseShape:
    """The envelope of one request's answer: id, created, model; chunk and final-body builders."""

    def __init__(self, kind: Kind, request_id: str, model: str, fingerprint: str | None) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.fingerprint = fingerprint

    def _head(self, obj: str) -> dict[str, Any]:
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.fingerprint:
            head["system_fingerprint"] = self.fingerprint
        return head

    def role_chunk(self, with_usage_field: bool) -> dict[str, Any]:
        """Chat streams open with the assistant's role (sent with the first token, as vLLM does)."""
        body = self._head("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]
        if with_usage_field:
            body["usage"] = None
        return body

    def chunk(self, text: str, finish_reason: str | None, with_usage_field: bool) -> dict[str, Any]:
        if self.kind == "chat":
            delta = {"content": text} if text or finish_reason is None else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def final(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
