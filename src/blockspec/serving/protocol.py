"""The OpenAI request side of the server: limits, request schemas (strict: unknown
fields are 400, as in vLLM), body reading, and the conversion of a request into a
prompt and `SamplingParams`. Every failure is an `ApiError` (an OpenAI-style error)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from blockspec.config import GenerationDefaults, SamplingParams
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_CHOICES = 128       # prompts x n of one request; each is an engine request
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/version", "/tokenizer_info")
# chat_template_kwargs names the renderer sets itself
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
                            "special_tokens", "chat_template", "tokenize")
CLIENT_CLOSED = 499     # nginx's "client closed request": only ever seen in /metrics
# Default prompt-size limit in bytes, checked before tokenizing: this many bytes per token of
# the prompt-token limit. Real tokenizers average 3-5 bytes per token; a prompt beyond 16 is
# refused unread rather than tokenized (CPU time) only to be refused for its token count.
BYTES_PER_TOKEN = 16


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and queue limits of the HTTP layer (the engine has its own)."""

    max_body_bytes: int = 1 << 20
    max_queue: int = 256                  # requests waiting beyond the engine's slots; then 429
    max_prompt_tokens: int | None = None  # None: engine.max_model_len - 1
    max_tokens: int | None = None         # None: engine.max_model_len - 1
    max_prompt_bytes: int | None = None   # None: BYTES_PER_TOKEN x the prompt-token limit

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_tokens", "max_tokens", "max_prompt_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BlockspecError(f"server limit {name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise BlockspecError(f"server limit max_queue must be an integer >= 0, got {self.max_queue!r}")


# -- errors -------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the top-level field."""
    err = exc.errors(include_url=False)[0]
    loc = err["loc"]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {err['msg']}")
    if not loc:
        return ApiError(400, f"the request body must be a JSON object: {err['msg']}")
    field, path = str(loc[0]), ".".join(str(part) for part in loc)
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unknown or unsupported field '{path}'", field)
    return ApiError(400, f"invalid '{path}': {err['msg']}", field)


# -- request schemas ------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "5" is not an int and true is not 1, as in the OpenAI API; unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                    # vLLM / SGLang extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None     # vLLM extension
    ignore_eos: bool = False                    # vLLM extension
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None                     # bookkeeping only: accepted, ignored
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None     # vLLM extension
    min_p: float | None = None                  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None                 # legacy: this many alternatives per token
    best_of: int | None = None
    suffix: Any = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatTemplateFields(_Strict):
    """How a chat is rendered (vLLM's fields): /v1/chat/completions and /tokenize."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM extension, e.g. {"enable_thinking": false}
    add_generation_prompt: bool | None = None   # None: true unless continue_final_message
    continue_final_message: bool = False


class ChatRequest(SamplingFields, ChatTemplateFields):
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None      # bookkeeping only
    parallel_tool_calls: bool | None = None     # meaningless without tools
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}

M = TypeVar("M", bound=_Strict)


def parse_request(model: type[M], body: bytes) -> M:
    try:
        req = model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None
    for name, allowed in NOOP_VALUES.items():
        value = getattr(req, name, None)
        # Compare types too: True == 1 must not pass as n=1.
        if not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise ApiError(400, f"'{name}' = {short_repr(value)} is not supported by this server "
                                f"(accepted: {', '.join(map(repr, allowed))})", name)
    if not isinstance(req, SamplingFields):
        return req
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")
    if not 1 <= req.n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be in 1..{MAX_CHOICES}, got {req.n}", "n")
    if getattr(req, "best_of", None) not in (None, req.n):   # no server-side ranking: vLLM V1's rule too
        raise ApiError(400, "'best_of' must equal 'n' (or be left out): this server returns every choice it "
                            "generates", "best_of")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return req


async def read_body(request: Request, limit: int) -> bytes:
    """The raw JSON body, refusing other content types and more than `limit` bytes."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "Content-Type must be application/json")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body exceeds {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # counted as it arrives: chunked bodies have no length
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, "the client closed the connection") from None
    return b"".join(chunks)


# -- from a request to SamplingParams ---------------------------------------------------

def prompt_token_limit(limits: ServerLimits, engine: Engine) -> int:
    return min(limits.max_prompt_tokens or engine.max_model_len - 1, engine.max_model_len - 1)


def prompt_byte_limit(limits: ServerLimits, engine: Engine) -> int:
    return limits.max_prompt_bytes or BYTES_PER_TOKEN * prompt_token_limit(limits, engine)


def check_prompt_bytes(text: str, limit: int, param: str) -> str:
    """`text`, or a 400 if its UTF-8 form exceeds `limit` bytes (checked before any tokenizing)."""
    # Each character is 1-4 UTF-8 bytes: the length alone settles most cases without a copy.
    if len(text) > limit or (4 * len(text) > limit and len(text.encode("utf-8", "surrogatepass")) > limit):
        raise ApiError(400, f"the prompt exceeds {limit} bytes, the most this server accepts "
                            "(--max-prompt-bytes)", param)
    return text


def token_budget(requested: int | None, prompt_len: int, engine: Engine, limits: ServerLimits,
                   prompt_param: str, max_param: str) -> int:
    """The request's token budget: at most the server limit and what fits in max_model_len."""
    model_len = engine.max_model_len
    prompt_limit = prompt_token_limit(limits, engine)
    if prompt_len > prompt_limit:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this server accepts at most {prompt_limit}",
                       prompt_param)
    room = model_len - prompt_len
    cap = limits.max_tokens or model_len - 1
    if requested is None:
        return min(cap, room)
    if requested < 0:
        raise ApiError(400, f"'{max_param}' must be >= 0 (0: nothing generated; with echo, the prompt's "
                            f"log-probabilities alone), got {requested}", max_param)
    if requested > cap:
        raise ApiError(400, f"'{max_param}' is {requested}; this server allows at most {cap}", max_param)
    if requested > room:
        raise ApiError(400, f"this model's maximum context length is {model_len} tokens; the prompt uses "
                            f"{prompt_len}, so '{max_param}' can be at most {room} (got {requested})", max_param)
    return requested


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                            "characters", "stop")
    return stops


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} with string keys -> {id: bias} (ranges: SamplingParams)."""
    out = {}
    for key, value in (raw or {}).items():
        if not key.isdigit():
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {short_repr(key)}", "logit_bias")
        out[int(key)] = value
    return out


def sampling_params(req: SamplingFields, max_new: int, vocab_size: int, max_param: str,
                    defaults: GenerationDefaults = GenerationDefaults(),
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    names: dict[str, str] | None = None) -> SamplingParams:
    """Map OpenAI fields over the checkpoint's generation_config.json defaults onto
    SamplingParams, whose own validation (the only one) names the bad field (`names`:
    SamplingParams field -> the request's, where they differ). Left out everywhere:
    OpenAI's temperature 1.0."""
    top_k = req.top_k
    if top_k is not None and top_k >= vocab_size:  # k >= vocab keeps everything anyway
        top_k = 0
    values = dict(temperature=req.temperature, top_k=top_k, top_p=req.top_p, min_p=req.min_p,
                  repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                  frequency_penalty=req.frequency_penalty)
    try:
        if req.temperature is None and defaults.temperature is None:
            values["temperature"] = 1.0   # the OpenAI default (below 1e-5: greedy)
        return defaults.sampling_params(
            **values, seed=req.seed, max_new_tokens=max_new, stop=stop_strings(req.stop),
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            logit_bias=logit_bias(req.logit_bias), logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except BlockspecError as exc:
        field = str(exc).split(" ", 1)[0]  # SamplingParams messages start with the field name
        field = max_param if field == "max_new_tokens" else (names or {}).get(field, field)
        raise ApiError(400, str(exc).replace("max_new_tokens", max_param), field) from None


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Tokenizer,
                       max_bytes: int) -> list[list[int]]:
    """Token ids of each prompt of a completion request (a string, token ids, or a list of
    either: independent prompts); text over `max_bytes` is refused untokenized. CPU work:
    the server runs it off the event loop."""
    if not prompt:
        raise ApiError(400, "'prompt' is empty", "prompt")
    many = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
    if len(many) > MAX_CHOICES:
        raise ApiError(400, f"'prompt' holds {len(many)} prompts; at most {MAX_CHOICES} per request", "prompt")
    return [tokenizer.encode(check_prompt_bytes(p, max_bytes, "prompt")) if isinstance(p, str) else list(p)
            for p in many]


def chat_text(req: ChatTemplateFields, tokenizer: Tokenizer, max_bytes: int) -> str:
    """The chat as the template renders it, with the request's template options, in a bounded
    template worker (a slow or huge template is a 400 naming it); a rendering over `max_bytes`
    is refused before it is tokenized."""
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                       "continue_final_message")
    bad = sorted(set(req.chat_template_kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
    if bad:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(bad)}: use the request's own fields",
                       "chat_template_kwargs")
    plain = [{"role": "system" if m.role == "developer" else m.role,  # "developer" is OpenAI's new "system"
              "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
             for m in req.messages]
    add_generation = not req.continue_final_message if req.add_generation_prompt is None else req.add_generation_prompt
    try:
        text = tokenizer.apply_chat_template(plain, add_generation, max_chars=max_bytes,   # characters <= UTF-8 bytes
                                             **(req.chat_template_kwargs or {}))
    except BlockspecError as exc:
        raise ApiError(400, str(exc), "messages") from None
    except TypeError as exc:   # a template variable given twice
        raise ApiError(400, f"'chat_template_kwargs': {exc}", "chat_template_kwargs") from None
    if req.continue_final_message:   # end the prompt right after the last message's content (transformers' rule)
        final = plain[-1]["content"]
        at = text.rfind(final) if final else -1
        if at < 0 or not final:
            raise ApiError(400, "'continue_final_message': the final message's content is empty or not in the "
                                "rendered chat", "continue_final_message")
        text = type(text)(text[:at + len(final)])
    return check_prompt_bytes(text, max_bytes, "messages")


def chat_prompt(text: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a rendered chat: the template wrote the special tokens (BOS), so it is
    encoded without adding any, as transformers does."""
    return tokenizer.encode(text, add_special_tokens=False)
