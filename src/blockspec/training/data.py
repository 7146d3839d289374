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

import torch

from blockspec.config import SamplingParams
from blockspec.errors import BlockspecError
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer


def load_prompts(source: str, tokenizer: Tokenizer, limit: int, seed: int = 0,
                 min_tokens: int = 16, max_tokens: int = 192) -> list[list[int]]:
    """Prompts as token ids from a jsonl file ({"prompt"} / {"text"} / {"messages"} per line)
    or from a corpus directory's train.jsonl (random code prefixes cut at a line end)."""
    path = Path(source)
    rng = random.Random(seed)
    if path.is_dir():
        corpus = path / "train.jsonl"
        if not corpus.is_file():
            raise BlockspecError(f"prompts: {path} has no train.jsonl")
        texts = [json.loads(line)["text"] for line in corpus.open()]
        prompts = []
        while len(prompts) < limit:
            text = rng.choice(texts)
            ids = tokenizer.encode(text)
            if len(ids) < min_tokens + 64:
                continue
            start = rng.randrange(0, len(ids) - min_tokens - 64)
            length = rng.randint(min_tokens, max_tokens)
            prompts.append(ids[start:start + length])
        return prompts
    if not path.is_file():
        raise BlockspecError(f"prompts: {path} does not exist")
    prompts = []
    for n, line in enumerate(path.open(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BlockspecError(f"prompts: {path}:{n} is not valid JSON ({exc})") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            text = tokenizer.apply_chat_template(row["messages"])
        elif isinstance(row, dict) and isinstance(row.get("prompt", row.get("text")), str):
            text = row.get("prompt", row.get("text"))
        elif isinstance(row, str):
            text = row
        else:
            raise BlockspecError(f"prompts: {path}:{n} needs a 'prompt', 'text' or 'messages' field")
        prompts.append(tokenizer.encode(text)[-max_tokens:])
        if len(prompts) >= limit:
            break
    return prompts


def regenerate(target: TargetModel, prompts: list[list[int]], out: Path, max_new_tokens: int = 256,
               batch_size: int = 16, temperature: float = 0.0, seed: int = 0) -> int:
    """Append {"prompt_ids", "response_ids"} lines for the prompts not yet in `out` (resumable)."""
    from rich.progress import Progress

    from blockspec.decoding.generate import generate

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
