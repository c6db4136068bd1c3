"""OpenAI chat requests as vLLM's OpenAI server takes them, on the engine replica (the process that has vLLM).

The HTTP front door (services/gateway/http_front.py) passes the request's sampling fields on as they came (a
plain dict: the gateway does not import vLLM). Here they are validated by vLLM's own request model
(`ChatCompletionRequest`) and turned into SamplingParams by its own `to_sampling_params`, so every parameter
means what it means in `vllm serve`. A forced tool choice (a named function, or "required") is served as vLLM
serves it: structured outputs over the tools' JSON schema (`get_json_schema_from_tools`).

`max_tokens` defaults, as in vLLM, to the rest of the model's context after the prompt, and a larger request
is cut to it."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from .errors import ApiError

if TYPE_CHECKING:  # vLLM loads with the engine replica's engine, not at import
    from vllm import SamplingParams

# What the gateway passes on to vLLM's request model (the sampling part of an OpenAI / vLLM chat request).
# Everything else a caller sends is either read by the gateway itself (messages, model, stream, user, ...) or
# refused by name there: nothing is dropped.
SAMPLING_FIELDS = (
    # OpenAI's
    "temperature", "top_p", "seed", "frequency_penalty", "presence_penalty", "stop", "n", "logprobs",
    "top_logprobs", "max_tokens", "max_completion_tokens", "logit_bias", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
    # vLLM's extra sampling parameters (its chat-completion-sampling-params)
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
    "structured_outputs",
)


MAX_N = 128  # choices per request, OpenAI's bound (vLLM has none; each choice holds its own KV)
# What one request may make the engine generate and the gateway gather (a non-streamed answer is built in its
# memory): choices x max_tokens, and with logprobs x (1 + top_logprobs) entries. n=128 x 8,192 tokens x 21 entries
# would be 22 million entries (gigabytes) from one caller; these bound it before the request reaches vLLM.
MAX_OUTPUT_TOKENS = 65_536
MAX_LOGPROB_ENTRIES = 262_144


def invalid(message: str, field: str | None = None) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field)


@dataclass
class OpenAIRequest:
    """A validated request: vLLM's SamplingParams and how its output becomes OpenAI choices."""
    sampling: SamplingParams
    top_logprobs: int | None  # None: no logprobs asked for
    tool_choice: str | None   # a forced function's name, "required", or None (plain content)


def _refusal(e: Exception) -> ApiError:
    """pydantic's or vLLM's refusal as INVALID_ARGUMENT naming the field (its first error's location, or vLLM's
    `parameter`)."""
    errors = getattr(e, "errors", None)
    if callable(errors):  # pydantic: the first error, with the field it is about
        try:
            first = errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("function-after", "function-before"))
            msg = str(first.get("msg", e)).removeprefix("Value error, ")
            return invalid(f"`{loc}`: {msg}" if loc else msg, loc or None)
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return invalid(text[:500], getattr(e, "parameter", None))


def request(fields: dict, prompt_len: int, max_model_len: int, defaults: dict | None = None) -> OpenAIRequest:
    """The sampling fields of an OpenAI chat request -> SamplingParams, validated as vLLM validates them.
    `defaults`: the model's own sampling defaults (its generation_config, as vLLM serve uses them)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    unknown = sorted(set(fields) - set(SAMPLING_FIELDS))
    if unknown:
        raise invalid(f"`{unknown[0]}` is not a sampling parameter this server passes to vLLM", unknown[0])
    try:
        req = ChatCompletionRequest.model_validate({"messages": [], **fields})
        if req.n is not None and req.n > MAX_N:
            raise invalid(f"`n` must be at most {MAX_N}, got {req.n}", "n")
        if req.tools and req.tool_choice == "auto":
            # vllm serve answers the same without a tool-call parser for the model (--tool-call-parser).
            raise invalid("`tool_choice` \"auto\" needs a tool-call parser for this model, which this server does "
                          "not have; send \"required\", a named function, or \"none\"", "tool_choice")
        forced = None
        if req.tools and req.tool_choice not in (None, "none"):
            if req.response_format is not None or req.structured_outputs is not None:
                raise invalid("`tool_choice` forces a tool call: it cannot be combined with `response_format` or "
                              "`structured_outputs`", "tool_choice")
            # (list is invariant: vLLM's list[Tool] does not take its own list[ChatCompletionToolsParam])
            schema = get_json_schema_from_tools(req.tool_choice, req.tools,  # type: ignore[arg-type]
                                                req.parallel_tool_calls)
            req.structured_outputs = StructuredOutputsParams(json=schema)
            # "required" or a named function ("auto" and "none" are out above)
            forced = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.function.name
        room = max_model_len - prompt_len
        asked = req.max_completion_tokens or req.max_tokens
        sp = req.to_sampling_params(min(asked, room) if asked else room, dict(defaults or {}))
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - pydantic's or vLLM's own refusal: the caller's error, named
        raise _refusal(e) from None
    sp.output_kind = RequestOutputKind.DELTA  # streamed or not, the replica forwards pieces as they come
    top = req.top_logprobs if req.logprobs else None
    assert sp.max_tokens is not None  # to_sampling_params was given one
    check_output_size(sp.n, sp.max_tokens, top)
    return OpenAIRequest(sp, top, forced)


def check_output_size(n: int, max_tokens: int, top_logprobs: int | None) -> None:
    """Refuses (RESOURCE_EXHAUSTED, naming the product) a request whose output could pass MAX_OUTPUT_TOKENS or
    MAX_LOGPROB_ENTRIES; `max_tokens` is what vLLM would run with (the rest of the context when not given)."""
    tokens = n * max_tokens
    if tokens > MAX_OUTPUT_TOKENS:
        raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"n ({n}) x max_tokens ({max_tokens}) = {tokens} tokens, the limit per request is "
                       f"{MAX_OUTPUT_TOKENS}: lower n or set max_completion_tokens", field="n")
    if top_logprobs is not None and tokens * (1 + top_logprobs) > MAX_LOGPROB_ENTRIES:
        raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"n ({n}) x max_tokens ({max_tokens}) x (1 + top_logprobs ({top_logprobs})) = "
                       f"{tokens * (1 + top_logprobs)} logprob entries, the limit per request is "
                       f"{MAX_LOGPROB_ENTRIES}", field="top_logprobs")


def logprobs_content(token_ids, logprobs, top_n: int, tokenizer) -> list[dict]:
    """vLLM's per-token logprobs -> OpenAI's `logprobs.content` entries (token, logprob, bytes, top_logprobs)."""
    out = []
    for tid, lps in zip(token_ids, logprobs or ()):
        def entry(token_id, lp):
            tok = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])
            return {"token": tok, "logprob": max(float(lp.logprob), -9999.0), "bytes": list(tok.encode("utf-8"))}

        top = sorted(lps.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:top_n]
        out.append({**entry(tid, lps[tid]), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return out


def tool_calls(text: str, forced: str) -> list[dict] | None:
    """The tool calls in a forced tool call's output: a named function's arguments (the whole text), or
    "required"'s JSON list of {"name", "parameters"}. None when the output is not one (cut by max_tokens)."""
    def call(name: str, arguments: str) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}

    if forced != "required":
        return [call(forced, text)]
    try:
        calls = json.loads(text)
        return [call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]
    except (ValueError, TypeError, KeyError):
        return None
