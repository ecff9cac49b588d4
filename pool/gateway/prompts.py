"""From an OpenAI request body to what the pool takes: prompt token ids and `SamplingParams`.

Everything a client can get wrong is caught here, before the pool sees the
request, as a 400 naming the field: features the engine lacks (n > 1,
logprobs, tools, ...), empty or over-long prompts, token ids outside the
vocabulary, and `max_tokens` beyond the model's context (vLLM's wording).
When `max_tokens` is absent a completion gets 16 tokens (OpenAI's default)
and a chat the smaller of `default_chat_max_tokens` and the room left in
the context - not all of it, as vLLM does, because the scheduler reserves KV
for the whole `max_tokens` of every request it admits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pool.engines.base import SamplingParams
from pool.gateway.errors import APIError, bad_request
from pool.gateway.schemas import ChatCompletionRequest, CompletionRequest
from pool.served import ModelInfo

COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def prepare(body: CompletionRequest | ChatCompletionRequest, info: ModelInfo, tokenizer: Any,
            default_chat_max_tokens: int) -> Prepared:
    if isinstance(body, ChatCompletionRequest):
        _check_chat(body)
        ids, where = chat_prompt_ids(body, tokenizer), "messages"
        asked, asked_field = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                              else (body.max_tokens, "max_tokens"))
        default = default_chat_max_tokens
    else:
        _check_completion(body)
        ids, where = completion_prompt_ids(body, tokenizer, info.vocab_size or len(tokenizer)), "prompt"
        asked, asked_field, default = body.max_tokens, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS
    _check_common(body)
    if not ids:
        raise bad_request(f"{where}: the prompt is empty (0 tokens)", where)
    limit = info.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {where} resulted in "
                          f"{len(ids)} tokens, leaving no room for output. Please reduce the length of the {where}.",
                          where, "context_length_exceeded")
    if asked is None:
        max_tokens = min(default, limit - len(ids))
    elif len(ids) + asked > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(ids) + asked} tokens ({len(ids)} in the {where}, {asked} in the completion). "
                          f"Please reduce the length of the {where} or completion.", asked_field,
                          "context_length_exceeded")
    else:
        max_tokens = asked
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop: stop strings must not be empty", "stop")
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        max_tokens=max_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
    )
    options = body.stream_options
    return Prepared(ids, sampling, bool(body.stream), bool(body.stream and options and options.include_usage))


def completion_prompt_ids(body: CompletionRequest, tokenizer: Any, vocab_size: int) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(f"prompt: a batch of {len(prompt)} prompts is not supported; send one per request",
                              "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(tokenizer, prompt, add_special_tokens=True)
    ids = list(prompt)  # token ids
    bad = [t for t in ids if not 0 <= t < vocab_size]  # type: ignore[operator]
    if bad:
        raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
    return ids  # type: ignore[return-value]


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    messages = []
    for index, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages.{index}.content.{k}: only text parts are supported "
                                      f"(got type {part.type!r})", f"messages.{index}.content")
                parts.append(part.text)
            content = "".join(parts)
        entry = {"role": message.role, "content": content or ""}
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request(f"model {body.model!r} has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt is not False,
                                             tokenize=False, **(body.chat_template_kwargs or {}))
    except Exception as exc:  # jinja raises for roles or shapes a template rejects
        raise bad_request(f"messages: the model's chat template rejected them: {exc}", "messages") from None
    return encode(tokenizer, text, add_special_tokens=False)


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; straight through the Rust tokenizer when there is one (HF's __call__ costs ~0.25 ms)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _unsupported(field: str, what: str) -> APIError:
    return bad_request(f"{field}: {what} is not supported by this server", field)


def _check_common(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.n not in (None, 1):
        raise _unsupported("n", f"n={body.n} (more than one choice)")
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(body, field):
            raise _unsupported(field, f"a non-zero {field}")
    if body.logit_bias:
        raise _unsupported("logit_bias", "logit_bias")


def _check_completion(body: CompletionRequest) -> None:
    if body.echo:
        raise _unsupported("echo", "echo")
    if body.logprobs is not None:
        raise _unsupported("logprobs", "logprobs")
    if body.best_of not in (None, 1):
        raise _unsupported("best_of", f"best_of={body.best_of}")
    if body.suffix:
        raise _unsupported("suffix", "suffix")


def _check_chat(body: ChatCompletionRequest) -> None:
    if body.logprobs or body.top_logprobs is not None:
        raise _unsupported("logprobs", "logprobs")
    if body.tools:
        raise _unsupported("tools", "tool calling")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise _unsupported("response_format", f"response_format {body.response_format.get('type')!r}")
