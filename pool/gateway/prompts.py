"""From an OpenAI request body to what the pool takes: prompt token ids and `SamplingParams`.

Everything a client can get wrong is caught here, before the pool sees the
request, as a 400 naming the field: features the engine lacks (n > 1,
logprobs, tools, ...), empty or over-long prompts, token ids outside the
vocabulary, and `max_tokens` beyond the model's context (vLLM's wording).
When `max_tokens` is absent a completion gets 16 tokens (OpenAI's default)
and a chat the smaller of `default_chat_max_tokens` and the room left in
the context - not all of it, as vLLM does, because the scheduler reserves KV
for the whole `max_tokens` of every request it admits.

What a client may send is bounded (`RequestLimits`): stop strings (count and
total length), stop token ids, messages, and the prompt's characters before
it is tokenised (no prompt longer than the context in tokens can be sent in
more characters than the context times the longest token). A chat template
sent with the request (`chat_template`, or `chat_template_kwargs.chat_template`)
is refused unless the operator trusts them (vLLM's answer to CVE-2025-61620:
a template is a program, and one nested loop froze the server); the
template's other variables pass through, unknown ones are dropped (as vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

from pool.engines.base import SamplingParams
from pool.gateway.errors import APIError, bad_request
from pool.gateway.schemas import ChatCompletionRequest, CompletionRequest
from pool.served import ModelInfo

COMPLETION_DEFAULT_MAX_TOKENS = 16
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})  # never from a request (vLLM refuses them too)
OWN_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt"})  # set from the body's own fields


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; past each the answer is a 400 naming the field."""

    max_stop_strings: int = 64
    max_stop_chars: int = 4096  # all stop strings together
    max_stop_token_ids: int = 1024
    max_messages: int = 4096
    trust_request_chat_template: bool = False  # the operator's opt-in (`serve --trust-request-chat-template`)
    template_timeout_s: float = 10.0  # rendering plus tokenising a chat, off the event loop, at most this long


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def check(body: CompletionRequest | ChatCompletionRequest, limits: RequestLimits, max_prompt_chars: int | None,
          vocab_size: int) -> None:
    """What can be refused before any tokenising or template rendering (cheap: on the event loop)."""
    if isinstance(body, ChatCompletionRequest):
        _check_chat(body, limits)
        chars, where = sum(_content_chars(m.content) for m in body.messages), "messages"
    else:
        _check_completion(body)
        chars, where = _prompt_chars(body.prompt), "prompt"
    _check_common(body, limits, vocab_size)
    if max_prompt_chars is not None and chars > max_prompt_chars:
        raise bad_request(f"{where}: {chars} characters cannot fit the model's context (at most {max_prompt_chars} "
                          "characters, the context times the longest token)", where, "context_length_exceeded")


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """Most characters a prompt of `max_model_len` tokens can have: the context times the longest token's text."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    longest = max((len(token) for token in vocab()), default=0)
    return max_model_len * max(longest, 1) if longest else None


def prepare(body: CompletionRequest | ChatCompletionRequest, info: ModelInfo, tokenizer: Any,
            default_chat_max_tokens: int, limits: RequestLimits = RequestLimits()) -> Prepared:
    if isinstance(body, ChatCompletionRequest):
        _check_chat(body, limits)
        ids, where = chat_prompt_ids(body, tokenizer, limits), "messages"
        asked, asked_field = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                              else (body.max_tokens, "max_tokens"))
        default = default_chat_max_tokens
    else:
        _check_completion(body)
        ids, where = completion_prompt_ids(body, tokenizer, info.vocab_size or len(tokenizer)), "prompt"
        asked, asked_field, default = body.max_tokens, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS
    _check_common(body, limits, info.vocab_size or len(tokenizer))
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
    stop = _stops(body)
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


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Any, limits: RequestLimits = RequestLimits()) -> list[int]:
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
    kwargs = dict(body.chat_template_kwargs or {})
    requested = body.chat_template or kwargs.pop("chat_template", None)  # refused by check() unless trusted
    kwargs.pop("chat_template", None)
    own = getattr(tokenizer, "chat_template", None)
    if requested is None and own is None:
        raise bad_request(f"model {body.model!r} has no chat template; use /v1/completions", "messages")
    try:
        source = requested if requested is not None else own
        if not isinstance(source, str):  # named templates: the tokenizer's default one
            source = tokenizer.get_chat_template(None)
        variables = template_variables(source)
        extra = {k: v for k, v in kwargs.items() if k in variables}
        if requested is not None:
            extra["chat_template"] = requested
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt is not False,
                                             tokenize=False, **extra)
    except Exception as exc:  # jinja raises for roles or shapes a template rejects
        raise bad_request(f"messages: the chat template rejected them: {exc}", "messages") from None
    return encode(tokenizer, text, add_special_tokens=False)


@lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads that a request's `chat_template_kwargs` may set."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        found = jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateError:
        return frozenset()  # HF's own environment may know more tags; it reports the error when it renders
    return frozenset(found) - OWN_TEMPLATE_VARIABLES - RESERVED_TEMPLATE_KWARGS


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; straight through the Rust tokenizer when there is one (HF's __call__ costs ~0.25 ms)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _unsupported(field: str, what: str) -> APIError:
    return bad_request(f"{field}: {what} is not supported by this server", field)


def _stops(body: CompletionRequest | ChatCompletionRequest) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def _content_chars(content: Any) -> int:
    if isinstance(content, list):
        return sum(len(part.text or "") for part in content)
    return len(content or "")


def _prompt_chars(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(len(p) for p in prompt)
    return 0  # token ids: counted against the context once read


def _check_common(body: CompletionRequest | ChatCompletionRequest, limits: RequestLimits, vocab_size: int) -> None:
    stop = _stops(body)
    if any(not s for s in stop):
        raise bad_request("stop: stop strings must not be empty", "stop")
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"stop: {len(stop)} stop strings, more than the {limits.max_stop_strings} allowed", "stop")
    if sum(map(len, stop)) > limits.max_stop_chars:
        raise bad_request(f"stop: {sum(map(len, stop))} characters of stop strings, more than the "
                          f"{limits.max_stop_chars} allowed", "stop")
    stop_ids = body.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_token_ids:
        raise bad_request(f"stop_token_ids: {len(stop_ids)} ids, more than the {limits.max_stop_token_ids} allowed",
                          "stop_token_ids")
    outside = [t for t in stop_ids if not 0 <= t < vocab_size]
    if outside:
        raise bad_request(f"stop_token_ids: token id(s) {outside[:8]} are outside the vocabulary (0..{vocab_size - 1})",
                          "stop_token_ids")
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


def _check_chat(body: ChatCompletionRequest, limits: RequestLimits) -> None:
    if len(body.messages) > limits.max_messages:
        raise bad_request(f"messages: {len(body.messages)} messages, more than the {limits.max_messages} allowed",
                          "messages")
    kwargs = body.chat_template_kwargs or {}
    if not limits.trust_request_chat_template and (body.chat_template is not None
                                                   or kwargs.get("chat_template") is not None):
        raise bad_request("chat_template: a chat template was sent with the request, but the server does not run "
                          "request templates (start it with --trust-request-chat-template to allow them)",
                          "chat_template", "untrusted_chat_template")
    if "tokenize" in kwargs:
        raise bad_request("chat_template_kwargs.tokenize: may not be set by a request", "chat_template_kwargs")
    if body.logprobs or body.top_logprobs is not None:
        raise _unsupported("logprobs", "logprobs")
    if body.tools:
        raise _unsupported("tools", "tool calling")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise _unsupported("response_format", f"response_format {body.response_format.get('type')!r}")
