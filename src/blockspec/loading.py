"""Model loading for the library: target + tokenizer + drafts, the embedded models by default.

The CLI, the server and the bench all load through here (nothing imports the CLI).
Sits at the decoding level or below: it imports config / models / embedded only.

Device and dtype (`models.checkpoint`): `device` "cpu" (the library default), "cuda",
"cuda:1" or "auto"/None (cuda when available). `dtype` a name, "auto" (the target
checkpoint's dtype) or None ("auto" on a GPU, float32 on the CPU, where bfloat16
matmuls are slow). Drafts always run in the target's dtype. Every config is checked
against its checkpoint's tensor headers and the free memory before anything is
allocated; weights with NaN / Inf are refused unless `allow_nonfinite=True`.

Generation defaults (generation_config.json, honoured like vLLM's default): the target's
eos ids from that file join `target.config.eos_token_id` (so they stop every request
that does not set ignore_eos), and `LoadedModels.generation_defaults` (a
`config.GenerationDefaults`) holds its temperature / top_p / top_k / max_new_tokens:
`models.generation_defaults.sampling_params(temperature=None, top_p=0.9, ...)` gives a
request's SamplingParams, its own non-None values overriding the checkpoint's, the
checkpoint's overriding SamplingParams' built-in defaults. Settings blockspec does not
implement (typical_p, epsilon_cutoff, ...) are listed in `.unsupported` and logged
once at load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockspec import embedded
from blockspec.config import (DRAFT_METHODS, EAGLE3_ARCHITECTURES, METHODS, DraftConfig, EagleTree, GenerationDefaults,
                              read_json)
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import Eagle3Drafter
from blockspec.models.checkpoint import load_draft, load_eagle3, load_target
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModels:
    target: TargetModel
    tokenizer: Tokenizer
    draft: DraftModel | Eagle3Drafter | None   # None for method "ar"
    method: str
    # The target checkpoint's generation_config.json sampling defaults (module docstring).
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


def load_generation_defaults(target_dir: str | Path) -> GenerationDefaults:
    """A target directory's generation_config.json defaults (empty when there is none)."""
    defaults = GenerationDefaults.load(Path(target_dir))
    if defaults.unsupported:
        log.warning("%s/generation_config.json sets %s, which blockspec does not implement; requests run "
                    "without them", target_dir, ", ".join(defaults.unsupported))
    return defaults


def load_models(target: str | Path | None = None, draft: str | Path | None = None, method: str = "ar", *,
                block_size: int | None = None, dtype: str | torch.dtype | None = None,
                device: str | torch.device | None = "cpu", allow_nonfinite: bool = False,
                chat_template: str | Path | None = None, tree: EagleTree | None = None) -> LoadedModels:
    """Target, tokenizer and (for speculative methods) draft; None = the embedded models.

    `block_size` runs the draft with a shorter block than trained (a new draft value,
    weights shared; for "eagle3": a chain of block_size - 1 drafts, any length); it is
    ignored for method "ar". `tree`: an EAGLE-3 draft drafts this tree instead of a chain
    (method "eagle3" only; `EagleTree`). dtype / device / allow_nonfinite:
    see the module docstring. `chat_template` (`--chat-template`): a file, an inline
    template or a template name replacing the checkpoint's (models.chat_template).
    """
    target_dir = Path(target) if target else embedded.default_target()
    target_model = load_target(target_dir, dtype=dtype, device=device, allow_nonfinite=allow_nonfinite)
    tokenizer = Tokenizer(target_dir, chat_template=chat_template)  # refuses a bad or hostile chat template
    tokenizer.check_fits(target_model.config.vocab_size)
    draft_model = None
    if tree is not None and method != "eagle3":
        raise BlockspecError(f"a draft tree (topk > 1) is EAGLE-3's (method eagle3), not method {method}'s")
    if method != "ar":
        if method not in DRAFT_METHODS:
            raise BlockspecError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
        draft_model = load_drafts(target_model, {method: draft}, [method], allow_nonfinite=allow_nonfinite)[method]
        if block_size:
            draft_model = draft_model.with_block_size(block_size)
        if tree is not None:
            assert isinstance(draft_model, Eagle3Drafter)
            draft_model = draft_model.with_tree(tree)
    return LoadedModels(target_model, tokenizer, draft_model, method, load_generation_defaults(target_dir))


def draft_method(draft_dir: Path) -> str:
    """The method a draft directory runs: eagle3 for a LlamaForCausalLMEagle3 config, dspark
    for a draft with a DSpark head, else dflash."""
    raw = read_json(draft_dir / "config.json", "draft config")
    if any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or []):
        return "eagle3"
    return "dspark" if DraftConfig.load(draft_dir).is_dspark else "dflash"


def load_drafts(target_model: TargetModel, drafts: Mapping[str, str | Path | None], kinds: Iterable[str],
                dtype: str | torch.dtype | None = None, device: str | torch.device | None = None, *,
                allow_nonfinite: bool = False) -> dict[str, DraftModel | Eagle3Drafter]:
    """{draft kind: draft} for these draft kinds ("dflash" / "dspark" / "eagle3"), checked
    against the target.

    `drafts` maps a kind to its directory; a missing or None entry loads the embedded
    draft of that kind. dtype / device None: the target's.
    An EAGLE-3 draft (LlamaForCausalLMEagle3, as vLLM and SGLang read it) comes paired with
    the target, drafting chains of `config.DEFAULT_CHAIN_DRAFTS`.
    """
    needed = sorted(set(kinds))
    unknown = [k for k in needed if k not in DRAFT_METHODS]
    if unknown:
        raise BlockspecError(f"unknown draft kind(s) {unknown} (choose from {', '.join(DRAFT_METHODS)})")
    loaded = {}
    for kind in needed:
        directory = drafts.get(kind)
        path = Path(directory) if directory else embedded.default_draft(kind)
        how = dict(dtype=target_model.dtype if dtype in (None, "auto") else dtype,
                   device=target_model.device if device is None else device,
                   target=target_model, allow_nonfinite=allow_nonfinite)
        if kind == "eagle3":
            loaded[kind] = Eagle3Drafter.pair(load_eagle3(path, **how), target_model)
        else:
            loaded[kind] = load_draft(path, **how)
    if "dspark" in loaded and not loaded["dspark"].config.is_dspark:
        raise BlockspecError("the dspark draft has neither a Markov nor a confidence head (is it a DFlash draft?)")
    return loaded
