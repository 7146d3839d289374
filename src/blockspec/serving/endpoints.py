"""vLLM's operational endpoints, with vLLM's request and response shapes:

- POST /tokenize: {"prompt", "add_special_tokens" (default true)} or a chat {"messages",
  "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
  "add_special_tokens" (default false)}, either with "return_token_strs" ->
  {"count", "max_model_len", "tokens", "token_strs"};
- POST /detokenize: {"tokens"} -> {"prompt"};
- GET /version -> {"version"};
- GET /v1/models/{id}: the model card, 404 for another id;
- GET /tokenizer_info: the special tokens, chat template and length limit that
  lm-evaluation-harness's `tokenizer_backend=remote` reads.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from blockspec import __version__
from blockspec.serving.protocol import (ApiError, ChatTemplateFields, _Strict, check_prompt_bytes, parse_request,
                                        read_body, chat_text, short_repr)


class TokenizeText(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(ChatTemplateFields):
    model: str | None = None
    add_special_tokens: bool = False   # the template writes them
    return_token_strs: bool = False


class Detokenize(_Strict):
    model: str | None = None
    tokens: list[int]


def add_operational_routes(app: FastAPI, service: Any, model_card: Callable[[], dict[str, Any]]) -> None:
    """The endpoints above, on `service`'s tokenizer, engine limits and worker threads."""
    tokenizer, engine = service.tokenizer, service.engine

    def check_model(model: str | None) -> None:
        if model is not None and model != service.model_name:
            raise ApiError(404, f"the model '{short_repr(model)}' does not exist; this server serves "
                                f"'{service.model_name}'", "model")

    def tokenize(body: bytes) -> dict[str, Any]:
        try:
            raw = json.loads(body)
        except ValueError:
            raw = None   # parse_request names the JSON error
        chat = isinstance(raw, dict) and "messages" in raw
        req = parse_request(TokenizeChat if chat else TokenizeText, body)
        check_model(req.model)
        text = chat_text(req, tokenizer, service.max_prompt_bytes) if chat else req.prompt
        ids = tokenizer.encode(check_prompt_bytes(text, service.max_prompt_bytes, "messages" if chat else "prompt"),
                               add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": [tokenizer.token_text(t) for t in ids] if req.return_token_strs else None}

    def detokenize(body: bytes) -> dict[str, Any]:
        req = parse_request(Detokenize, body)
        check_model(req.model)
        vocab = engine.target.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:8]} are outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        body = await read_body(request, service.limits.max_body_bytes)
        return JSONResponse(await service.off_loop(tokenize, body))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        body = await read_body(request, service.limits.max_body_bytes)
        return JSONResponse(await service.off_loop(detokenize, body))

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != service.model_name:
            raise ApiError(404, f"the model '{short_repr(model_id)}' does not exist; this server serves "
                                f"'{service.model_name}'", "model")
        return JSONResponse(model_card())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        special = tokenizer.special_tokens
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", **{
            name: special.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
            "chat_template": tokenizer.chat_template, "model_max_length": engine.max_model_len,
            "vocab_size": tokenizer.vocab_size})
