"""Tokenizer from `tokenizer.json` (the `tokenizers` library) plus the chat
template and special tokens of `tokenizer_config.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from blockspec.config import read_json
from blockspec.errors import BlockspecError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...} form
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise BlockspecError(f"tokenizer: {path} does not exist")
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise BlockspecError(f"tokenizer: cannot read {path}: {exc}") from None
        cfg_path = directory / "tokenizer_config.json"
        self.config = read_json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        eos = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self.backend.token_to_id(eos) if eos else None
        pad = _token_text(self.config.get("pad_token"))
        self.pad_token_id = self.backend.token_to_id(pad) if pad else None
        mask = _token_text(self.config.get("mask_token"))
        self.mask_token_id = self.backend.token_to_id(mask) if mask else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise BlockspecError("this tokenizer has no chat_template in tokenizer_config.json")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BlockspecError("each chat message needs string 'role' and 'content' fields")
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=False)
        try:
            return env.from_string(self.chat_template).render(messages=messages,
                                                              add_generation_prompt=add_generation_prompt,
                                                              bos_token="", eos_token="")
        except jinja2.TemplateError as exc:
            raise BlockspecError(f"chat template failed: {exc}") from None
