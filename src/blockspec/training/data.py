"""Training data for drafters: prompts, target-regenerated responses, loss masks.

The draft must learn the *target's* distribution, so responses are written by
the target itself (`regenerate`), batched and resumable; loss is taken on
response tokens only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer


def load_prompts(source: str, tokenizer: Tokenizer, limit: int, seed: int = 0,
                 min_tokens: int = 16, max_tokens: int = 192) -> list[list[int]]:
    """Prompts as token ids from a jsonl file ({"prompt"} / {"text"} / {"messages"} per line)
    or from a corpus directory's train.jsonl (random token windows of its files)."""
    path = Path(source)
    rng = random.Random(seed)
    if path.is_dir():
        corpus = path / "train.jsonl"
        if not corpus.is_file():
            raise BlockspecError(f"prompts: {path} has no train.jsonl")
        texts = [json.loads(line)["text"] for line in corpus.open()]
        prompts, encoded = [], {}
        while len(prompts) < limit:
            k = rng.randrange(len(texts))   # same draws as rng.choice: prompt sets stay reproducible
            if k not in encoded:            # a file is encoded once however often it is drawn
                encoded[k] = tokenizer.encode(texts[k])
            ids = encoded[k]
            if len(ids) <= min_tokens + 64:
                continue
            start = rng.randrange(0, len(ids) - min_tokens - 64)
            length = rng.randint(min_tokens, max_tokens)
            prompts.append(ids[start:start + length])
        return prompts
    texts = [text for _, text in read_prompt_jsonl(path, tokenizer)]
    return [_keep_end(tokenizer.encode(text), max_tokens, tokenizer.bos_token_id) for text in texts[:limit]]


def _keep_end(ids: list[int], max_tokens: int, bos: int | None) -> list[int]:
    """The last `max_tokens` ids (what the model continues), keeping a leading BOS: models trained
    with one (Llama, Mistral) are off their distribution without it."""
    if len(ids) <= max_tokens:
        return ids
    if bos is not None and ids[0] == bos and max_tokens > 1:
        return [bos] + ids[len(ids) - max_tokens + 1:]
    return ids[-max_tokens:]


def _row_text(row: Any, tokenizer: Tokenizer | None, where: str) -> str:
    """A row's prompt text. Chat rows come back as the tokenizer's RenderedChat, exactly as
    transformers renders them (with a generation prompt), which `Tokenizer.encode` encodes without
    adding special tokens (the template wrote them)."""
    if isinstance(row, dict) and "messages" in row:
        if not isinstance(row["messages"], list):
            raise BlockspecError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        if tokenizer is None:
            raise BlockspecError(f"{where}: 'messages' rows need a tokenizer (for the chat template)")
        try:
            return tokenizer.apply_chat_template(row["messages"])
        except BlockspecError as exc:
            raise BlockspecError(f"{where}: {exc}") from None
    if isinstance(row, dict):
        for key in ("prompt", "text"):
            if isinstance(row.get(key), str):
                return row[key]
    raise BlockspecError(f"{where}: needs a string 'prompt' or 'text' field, or a 'messages' list")


def read_prompt_jsonl(path: Path, tokenizer: Tokenizer | None = None) -> list[tuple[str, str]]:
    """(id, text) per line of {"prompt"} / {"text"} / {"messages"} objects; ids from
    `id` / `task_id`, else `<stem>/<line>`. Chat messages go through the chat template."""
    if not path.is_file():
        raise BlockspecError(f"prompts: {path} does not exist")
    prompts: list[tuple[str, str]] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"prompts: {path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BlockspecError(f"{where} is not valid JSON ({exc})") from None
            text = _row_text(row, tokenizer, where)
            if not text:
                raise BlockspecError(f"{where}: the prompt is empty")
            prompts.append((str(row.get("id", row.get("task_id", f"{path.stem}/{n}"))), text))
    if not prompts:
        raise BlockspecError(f"prompts: {path} holds no prompts")
    return prompts


def regenerate(target: TargetModel, prompts: list[list[int]], out: Path, max_new_tokens: int = 256,
               batch_size: int = 16, temperature: float = 0.0, seed: int = 0) -> int:
    """Append {"prompt_ids", "response_ids"} lines for the prompts not yet in `out` (resumable)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    done = sum(1 for _ in out.open()) if out.is_file() else 0
    with out.open("a") as f, Progress() as bar:
        task = bar.add_task("regenerate", total=len(prompts), completed=done)
        for start in range(done, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            params = [SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                     seed=seed + start + i) for i in range(len(chunk))]
            result = generate(target, chunk, params)
            for prompt, completion in zip(chunk, result.completions):
                f.write(json.dumps({"prompt_ids": prompt, "response_ids": completion.tokens}) + "\n")
            f.flush()
            bar.update(task, completed=start + len(chunk))
    return len(prompts)


@dataclass
class Example:
    ids: list[int]
    response_start: int


def load_examples(path: Path, max_len: int) -> list[Example]:
    if not Path(path).is_file():
        raise BlockspecError(f"training data: {path} does not exist (run `blockspec regenerate` first)")
    examples = []
    for n, line in enumerate(Path(path).open(), 1):
        row = json.loads(line)
        if not isinstance(row.get("prompt_ids"), list) or not isinstance(row.get("response_ids"), list):
            raise BlockspecError(f"training data: {path}:{n} needs 'prompt_ids' and 'response_ids'")
        ids = (row["prompt_ids"] + row["response_ids"])[:max_len]
        if len(ids) > len(row["prompt_ids"]) + 1:
            examples.append(Example(ids, len(row["prompt_ids"])))
    if not examples:
        raise BlockspecError(f"training data: {path} holds no usable examples")
    return examples


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [B, T] (right-padded), loss_mask [B, T] (True on response tokens)."""
    t = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), t, dtype=torch.bool)
    for r, e in enumerate(examples):
        ids[r, :len(e.ids)] = torch.tensor(e.ids)
        mask[r, e.response_start:len(e.ids)] = True
    return ids, mask
