"""Model loading for the library: target + tokenizer + drafts, the embedded models by default.

The CLI, the server and the bench all load through here (nothing imports the CLI).
Sits at the decoding level or below: it imports config / models / embedded only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec import embedded
from blockspec.config import DRAFT_METHODS
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_draft, load_target
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModels:
    target: TargetModel
    tokenizer: Tokenizer
    draft: DraftModel | None   # None for method "ar"
    method: str


def draft_kind(method: str) -> str | None:
    """The draft a method runs: "dflash" / "dspark" (variants such as "dspark-scheduled" included), else None."""
    kind = method.split("-", 1)[0]
    return kind if kind in DRAFT_METHODS else None


def load_models(target: str | Path | None = None, draft: str | Path | None = None, method: str = "ar", *,
                block_size: int | None = None, dtype: str = "float32",
                device: str | torch.device = "cpu") -> LoadedModels:
    """Target, tokenizer and (for speculative methods) draft; None = the embedded models.

    `block_size` runs the draft with a shorter block than trained (a new draft value,
    weights shared); it is ignored for method "ar".
    """
    target_dir = Path(target) if target else embedded.default_target()
    target_model = load_target(target_dir, dtype=dtype, device=device)
    tokenizer = Tokenizer(target_dir)
    draft_model = None
    if method != "ar":
        draft_dir = Path(draft) if draft else embedded.default_draft(method)
        draft_model = load_draft(draft_dir, dtype=dtype, device=device, target=target_model)
        if block_size:
            draft_model = draft_model.with_block_size(block_size)
    return LoadedModels(target_model, tokenizer, draft_model, method)


def load_drafts(target_model: TargetModel, drafts: Mapping[str, str | Path | None], methods: Iterable[str],
                dtype: str = "float32", device: str | torch.device = "cpu") -> dict[str, DraftModel]:
    """{draft kind: draft} for the drafts `methods` need (see `draft_kind`), checked against the target.

    `drafts` maps a kind ("dflash" / "dspark") to its directory; a missing or None entry
    loads the embedded draft of that kind.
    """
    needed = sorted({kind for kind in map(draft_kind, methods) if kind is not None})
    loaded = {}
    for kind in needed:
        directory = drafts.get(kind)
        loaded[kind] = load_draft(Path(directory) if directory else embedded.default_draft(kind), dtype=dtype,
                                  device=device, target=target_model)
    if "dspark" in loaded and not loaded["dspark"].config.is_dspark:
        raise BlockspecError("the dspark draft has neither a Markov nor a confidence head (is it a DFlash draft?)")
    return loaded
