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
from typing import Any, Iterator

import torch
from rich.progress import Progress

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer
from blockspec.training.conversations import chat_messages, render_conversation


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
        prompts, encoded, short = [], {}, set()
        while len(prompts) < limit:
            k = rng.randrange(len(texts))   # same draws as rng.choice: prompt sets stay reproducible
            if k not in encoded:            # a file is encoded once however often it is drawn
                encoded[k] = tokenizer.encode(texts[k])
            ids = encoded[k]
            if len(ids) <= min_tokens + 64:
                short.add(k)
                if len(short) == len(texts):   # every file drawn and none long enough: it would loop forever
                    raise BlockspecError(f"prompts: no file in {corpus} is longer than {min_tokens + 64} tokens")
                continue
            start = rng.randrange(0, len(ids) - min_tokens - 64)
            length = rng.randint(min_tokens, max_tokens)
            prompts.append(ids[start:start + length])
        return prompts
    texts = [text for _, text in read_prompt_jsonl(path, tokenizer)]
    return [keep_end(tokenizer.encode(text), max_tokens, tokenizer.bos_token_id) for text in texts[:limit]]


def keep_end(ids: list[int], max_tokens: int, bos: int | None) -> list[int]:
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


def jsonl_rows(path: Path, what: str) -> Iterator[tuple[int, Any, str]]:
    """(line number, parsed row, "what: path:line") for every non-blank line of a JSONL file."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{what}: {path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BlockspecError(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BlockspecError(f"{where} is not valid JSON ({exc})") from None
            except RecursionError:
                raise BlockspecError(f"{where} is nested too deeply") from None
            yield n, row, where


def read_prompt_jsonl(path: Path, tokenizer: Tokenizer | None = None) -> list[tuple[str, str]]:
    """(id, text) per line of {"prompt"} / {"text"} / {"messages"} objects; ids from
    `id` / `task_id`, else `<stem>/<line>`. Chat messages go through the chat template."""
    if not path.is_file():
        raise BlockspecError(f"prompts: {path} does not exist")
    prompts: list[tuple[str, str]] = []
    for n, row, where in jsonl_rows(path, "prompts"):
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
    """One training sequence. `response_start`: where the last trained answer begins (evaluation
    prompts end there); `loss_mask`: True on trained tokens (None: every token from
    response_start on, the `prompt_ids` / `response_ids` format)."""
    ids: list[int]
    response_start: int
    loss_mask: list[bool] | None = None

    def mask(self) -> list[bool]:
        if self.loss_mask is not None:
            return self.loss_mask
        return [False] * self.response_start + [True] * (len(self.ids) - self.response_start)


def _example(row: Any, max_len: int, tokenizer: Tokenizer | None, end_ids: set[int], where: str) -> Example | None:
    """A row as an Example cut to max_len, or None when fewer than 2 trained tokens are left."""
    messages = chat_messages(row, where)
    if messages is not None:
        if tokenizer is None:
            raise BlockspecError(f"{where}: conversation rows need the target's tokenizer (its chat template)")
        tools = row.get("tools") if isinstance(row.get("tools"), list) else None
        ids, mask, starts = render_conversation(tokenizer, messages, end_ids, where, tools)
        ids, mask = ids[:max_len], mask[:max_len]
        starts = [s for s in starts if s < len(ids) - 1]
        if sum(mask) < 2 or not starts:
            return None
        return Example(ids, starts[-1], mask)
    if not isinstance(row.get("prompt_ids"), list) or not isinstance(row.get("response_ids"), list):
        raise BlockspecError(f"{where}: needs 'prompt_ids' and 'response_ids', or a 'messages' / "
                             "'conversations' chat")
    ids = (row["prompt_ids"] + row["response_ids"])[:max_len]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise BlockspecError(f"{where}: 'prompt_ids' / 'response_ids' must hold token ids (ints >= 0)")
    if len(ids) > len(row["prompt_ids"]) + 1:
        return Example(ids, len(row["prompt_ids"]))
    return None


def load_examples(path: Path, max_len: int, tokenizer: Tokenizer | None = None,
                  end_ids: set[int] | None = None, vocab_size: int | None = None,
                  skipped: list[str] | None = None) -> list[Example]:
    """Training sequences of a JSONL file, one per line, in file order: `prompt_ids` +
    `response_ids` rows (loss on the response), or conversations (`messages` / ShareGPT
    `conversations`, rendered with the tokenizer's chat template, loss on every assistant turn;
    see conversations.py). Each is cut to `max_len` tokens; a row left with fewer than two trained
    tokens is skipped (its "file:line" appended to `skipped`, for the caller to report)."""
    if not Path(path).is_file():
        raise BlockspecError(f"training data: {path} does not exist (run `blockspec regenerate` first)")
    examples = []
    end_ids = set() if end_ids is None else end_ids
    for n, row, where in jsonl_rows(Path(path), "training data"):
        if not isinstance(row, dict):
            raise BlockspecError(f"{where}: each line must be a JSON object")
        example = _example(row, max_len, tokenizer, end_ids, where)
        if example is not None:
            if vocab_size is not None and max(example.ids) >= vocab_size:
                raise BlockspecError(f"{where}: token id {max(example.ids)} is outside the target's "
                                     f"vocabulary (0..{vocab_size - 1})")
            examples.append(example)
        elif skipped is not None:
            skipped.append(f"{path}:{n}")
    if not examples:
        raise BlockspecError(f"training data: {path} holds no usable examples")
    return examples


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [B, T] (right-padded to the longest), loss_mask [B, T] (True on trained tokens)."""
    t = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), t, dtype=torch.bool)
    for r, e in enumerate(examples):
        ids[r, :len(e.ids)] = torch.tensor(e.ids)
        mask[r, :len(e.ids)] = torch.tensor(e.mask())
    return ids, mask


@dataclass
class PackedRows:
    """Examples packed back to back into rows (`collate_packed`). `segments[r]`: the
    (example index, start, length) of each sequence in row r; `positions`: each token's
    position within its own sequence; `seg_start`: the index its sequence starts at (the
    padding after a row's last sequence is one more segment, never trained)."""
    ids: torch.Tensor          # [B, T]
    loss_mask: torch.Tensor    # [B, T]
    positions: torch.Tensor    # [B, T]
    seg_start: torch.Tensor    # [B, T]
    segments: list[list[tuple[int, int, int]]]

    def attention_mask(self) -> torch.Tensor:
        """[B, 1, T, T] block-diagonal causal: a token sees the earlier tokens of its own sequence."""
        t = self.ids.shape[1]
        idx = torch.arange(t, device=self.ids.device)
        same = self.seg_start.unsqueeze(-1) == self.seg_start.unsqueeze(-2)
        return (same & (idx.view(1, t, 1) >= idx.view(1, 1, t))).unsqueeze(1)

    def to(self, device: torch.device | str) -> "PackedRows":
        return PackedRows(self.ids.to(device), self.loss_mask.to(device), self.positions.to(device),
                          self.seg_start.to(device), self.segments)


def pack_rows(lengths: list[int], max_len: int) -> list[list[int]]:
    """First-fit by decreasing length: rows of example indices whose lengths sum to at most
    max_len (an example longer than max_len gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for k in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[k] <= free:
                rows[r].append(k)
                room[r] -= lengths[k]
                break
        else:
            rows.append([k])
            room.append(max_len - lengths[k])
    return rows


def collate_packed(examples: list[Example], pad_id: int, max_len: int) -> PackedRows:
    """Several examples back to back per row (`pack_rows`), right-padded to the longest row;
    loss masks per sequence as in `collate`."""
    rows = pack_rows([len(e.ids) for e in examples], max_len)
    t = max(sum(len(examples[k].ids) for k in row) for row in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    positions = torch.zeros(len(rows), t, dtype=torch.long)
    seg_start = torch.zeros(len(rows), t, dtype=torch.long)
    segments = []
    for r, row in enumerate(rows):
        start, segs = 0, []
        for k in row:
            e, n = examples[k], len(examples[k].ids)
            ids[r, start:start + n] = torch.tensor(e.ids)
            mask[r, start:start + n] = torch.tensor(e.mask())
            positions[r, start:start + n] = torch.arange(n)
            seg_start[r, start:start + n] = start
            segs.append((k, start, n))
            start += n
        positions[r, start:] = torch.arange(t - start)
        seg_start[r, start:] = start
        segments.append(segs)
    return PackedRows(ids, mask, positions, seg_start, segments)


class EpochBatches:
    """Deterministic epochs over n examples: epoch e visits every example exactly once, in the
    order of a permutation seeded by (seed, e) (no sampling with replacement). Step s takes the
    s-th `global_batch` of that order; the step alone locates the data, so a resumed run
    continues exactly where it stopped. Rank r of `world` takes every world-th example of the
    global batch. The last batch of an epoch is short; when it has fewer examples than ranks it
    is topped up with the epoch's first examples (as torch's DistributedSampler pads), so no
    rank is ever without data.

    `group_by_length`: within windows of 32 global batches, examples are ordered by length
    before being cut into batches (whose order is shuffled again), so a batch pads to similar
    lengths; each epoch still sees every example once."""

    WINDOW = 32

    def __init__(self, lengths: list[int], global_batch: int, seed: int = 0, group_by_length: bool = True) -> None:
        if global_batch <= 0 or not lengths:
            raise BlockspecError("training data: need at least one example and a batch size > 0")
        self.lengths, self.global_batch, self.seed = list(lengths), global_batch, seed
        self.group_by_length = group_by_length
        self.steps_per_epoch = -(-len(lengths) // global_batch)
        self._epoch, self._batches = -1, []

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of one epoch (example indices), in step order."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        g = self.global_batch
        if not self.group_by_length:
            return [order[i:i + g] for i in range(0, len(order), g)]
        batches = []
        for w in range(0, len(order), g * self.WINDOW):
            window = sorted(order[w:w + g * self.WINDOW], key=lambda k: -self.lengths[k])
            chunk = [window[i:i + g] for i in range(0, len(window), g)]
            rng.shuffle(chunk)
            batches += chunk
        # The short batch (if any) goes last, so every other step has a full global batch.
        batches.sort(key=lambda b: len(b) < g)
        return batches

    def batch(self, step: int, rank: int = 0, world: int = 1) -> list[int]:
        """The example indices rank `rank` trains on at `step` (0-based)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, self.epoch_batches(epoch)
        chosen = self._batches[k]
        if len(chosen) < world:
            first = [i for b in self._batches for i in b]
            chosen = chosen + first[:world - len(chosen)]
        return chosen[rank::world]


def default_mask_token_id(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The first embedding row past every token the tokenizer has (its vocabulary and added special
    tokens), as the published Qwen3 DFlash drafts use (151669 for Qwen3's 151669 tokens in a
    151936-row embedding): a row no text ever encodes to."""
    used = max(tokenizer.backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    first = max(used, tokenizer.vocab_size)
    if first >= vocab_size:
        raise BlockspecError(f"mask token: the tokenizer uses every embedding row of the target (ids 0..{first - 1}, "
                             f"vocab_size {vocab_size}); pass --mask-token-id (e.g. a reserved special token)")
    return first


def resolve_mask_token_id(requested: int | None, tokenizer: Tokenizer, vocab_size: int) -> int:
    """--mask-token-id: the id asked for (checked against the embedding), else the tokenizer's own
    mask_token when it has one, else `default_mask_token_id`."""
    if requested is not None and requested >= 0:
        if requested >= vocab_size:
            raise BlockspecError(f"--mask-token-id {requested} is outside the target's embedding (0..{vocab_size - 1})")
        return requested
    if requested is not None and requested != -1:
        raise BlockspecError(f"--mask-token-id must be a token id >= 0 (or -1: the default), got {requested}")
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    return default_mask_token_id(tokenizer, vocab_size)
