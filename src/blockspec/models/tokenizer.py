"""Tokenizer from `tokenizer.json` (the `tokenizers` library), with the special tokens and chat
templates of `tokenizer_config.json` / `chat_template.jinja`, behaving as transformers' tokenizer:

- `encode(text)` adds special tokens (BOS for Llama / Mistral) exactly as tokenizer.json's
  post-processor says, like `AutoTokenizer(text)`; a rendered chat prompt is encoded without
  adding any (the template already wrote them), like `apply_chat_template`.
- `apply_chat_template` renders through transformers (see models/chat_template.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from blockspec.config import read_json
from blockspec.config.common import side_file
from blockspec.errors import BlockspecError
from blockspec.models import chat_template as templates

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): the template sees each as a variable.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


MAX_TOKENIZER_BYTES = 512 << 20   # the largest real tokenizer.json files are tens of MB

def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...} (AddedToken) form
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """{name: token} as transformers' `special_tokens_map` (what templates get as variables): the
    named tokens plus model-specific `*_token` entries; a legacy special_tokens_map.json overrides
    the config when the config has no `added_tokens_decoder` (transformers' rule)."""
    found = dict(config)
    legacy = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        found.update(read_json(legacy, "special tokens map"))
    tokens = {}
    for key, value in found.items():
        if key in SPECIAL_TOKEN_NAMES or (key.endswith("_token") and isinstance(value, (str, dict))):
            text = _token_text(value)
            if text is not None:
                tokens[key] = text
    extra = found.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return tokens


class RenderedChat(str):
    """A prompt rendered by a chat template. It already holds the template's special tokens (BOS
    included), so `Tokenizer.encode` adds none, as transformers' apply_chat_template encodes it
    with add_special_tokens=False. The type travels with the text (jsonl prompts, the bench)."""


class Tokenizer:
    def __init__(self, directory: str | Path, chat_template: str | Path | None = None) -> None:
        """`chat_template`: a file, an inline template or one of the checkpoint's named templates
        (`--chat-template`), replacing the checkpoint's own."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise BlockspecError(f"tokenizer: {path} does not exist")
        side_file(path, "tokenizer", MAX_TOKENIZER_BYTES)
        self.directory = directory
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise BlockspecError(f"tokenizer: cannot read {path}: {exc}") from None
        cfg_path = directory / "tokenizer_config.json"
        self.config = read_json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}
        self.special_tokens = _special_tokens(directory, self.config)
        self.chat_templates = templates.load_templates(directory, self.config)
        self.template_source = str(directory)   # names the template in render errors
        if chat_template is not None:
            self.chat_templates = {"default": templates.resolve_override(chat_template, self.chat_templates)}
            self.template_source = f"--chat-template {str(chat_template)[:80]!r}"
        self.eos_token_id = self._token_id("eos_token")
        self.bos_token_id = self._token_id("bos_token")
        self.pad_token_id = self._token_id("pad_token")
        self.mask_token_id = self._token_id("mask_token")

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return self.backend.token_to_id(token) if token else None

    @property
    def chat_template(self) -> str | None:
        """The template a chat without tools is rendered with (None: the tokenizer has none)."""
        return self.chat_templates.get("default")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def check_fits(self, model_vocab_size: int) -> None:
        """Refuse a tokenizer that can produce ids the model has no embedding for (checked at
        load, so a prompt never fails later with an error blaming the client)."""
        top = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= model_vocab_size:
            raise BlockspecError(f"tokenizer: {self.directory}/tokenizer.json has token ids up to {top}, but the "
                                 f"model's vocabulary holds {model_vocab_size} (ids 0..{model_vocab_size - 1}): "
                                 "the tokenizer does not belong to this model")

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of `text`. By default special tokens are added as the tokenizer's own
        post-processor adds them (e.g. Llama-3's <|begin_of_text|>, Mistral's <s>), except for a
        RenderedChat, whose template wrote them already."""
        if add_special_tokens is None:
            add_special_tokens = not isinstance(text, RenderedChat)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (the `token` of a logprobs entry)."""
        return self.backend.decode([token], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None, max_chars: int = templates.MAX_CHARS,
                            **kwargs: Any) -> RenderedChat:
        """The prompt text, byte-identical to transformers' `apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)`; extra keyword arguments reach the template (e.g. enable_thinking).
        A render past its deadline, memory or `max_chars` is a BlockspecError (template_sandbox.py)."""
        template = templates.pick(self.chat_templates, tools)
        return RenderedChat(templates.render(template, messages, add_generation_prompt=add_generation_prompt,
                                             special_tokens=self.special_tokens, tools=tools,
                                             documents=documents, where=self.template_source,
                                             max_chars=max_chars, **kwargs))

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat, as transformers' `apply_chat_template(messages)` returns them."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))
