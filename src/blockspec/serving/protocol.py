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

from blockspec.config import SamplingParams
from blockspec.decoding.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import Tokenizer

MIN_TOP_P = 1e-6        # float32 rounds a smaller top_p to 0, which would drop every token
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
INT64 = (-2**63, 2**63 - 1)   # torch generators take 64-bit seeds
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
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
    # OpenAI fields the engine cannot honour: only their no-op values pass (NOOP_VALUES).
    n: Any = None
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None      # bookkeeping only
    parallel_tool_calls: bool | None = None     # meaningless without tools
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
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
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")
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
    if requested > cap:
        raise ApiError(400, f"'{max_param}' is {requested}; this server allows at most {cap}", max_param)
    if requested > room:
        raise ApiError(400, f"this model's maximum context length is {model_len} tokens; the prompt uses "
                            f"{prompt_len}, so '{max_param}' can be at most {room} (got {requested})", max_param)
    return requested  # <= 0 is left to SamplingParams, which names the problem


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                            "characters", "stop")
    return stops


def sampling_params(req: SamplingFields, max_new: int, vocab_size: int, max_param: str) -> SamplingParams:
    """Map OpenAI fields onto SamplingParams, whose own validation names the bad field."""
    temperature = 1.0 if req.temperature is None else req.temperature  # the OpenAI default (below 1e-5: greedy)
    top_k = req.top_k or 0
    if top_k == -1 or top_k >= vocab_size:  # vLLM's "off"; k >= vocab keeps everything anyway
        top_k = 0
    top_p = 1.0 if req.top_p is None else req.top_p
    if 0 < top_p < MIN_TOP_P:  # same result: the top token always holds more than 1e-6 of the mass
        top_p = MIN_TOP_P
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1]:
        raise ApiError(400, "'seed' must fit in a signed 64-bit integer", "seed")
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=req.seed,
                              max_new_tokens=max_new, stop=stop_strings(req.stop),
                              stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos)
    except BlockspecError as exc:
        field = str(exc).split(" ", 1)[0]  # SamplingParams messages start with the field name
        raise ApiError(400, str(exc).replace("max_new_tokens", max_param),
                       max_param if field == "max_new_tokens" else field) from None


def completion_prompt(prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Tokenizer,
                      max_bytes: int) -> list[int]:
    """Token ids of a completion prompt; text over `max_bytes` is refused untokenized. CPU work:
    the server runs it off the event loop."""
    if prompt and isinstance(prompt, list) and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported; send one request per prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(check_prompt_bytes(prompt, max_bytes, "prompt"))
    return list(prompt)


def chat_prompt(messages: list[ChatMessage], tokenizer: Tokenizer, max_bytes: int) -> list[int]:
    """Token ids of the rendered chat; a rendering over `max_bytes` is refused untokenized."""
    plain = [{"role": "system" if m.role == "developer" else m.role,  # "developer" is OpenAI's new "system"
              "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
             for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain)
    except BlockspecError as exc:
        raise ApiError(400, str(exc), "messages") from None
    # The template wrote the special tokens (BOS): encoded without adding any, as transformers does.
    return tokenizer.encode(check_prompt_bytes(text, max_bytes, "messages"), add_special_tokens=False)
