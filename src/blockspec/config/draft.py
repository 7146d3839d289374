"""A DFlash / DSpark draft's config: z-lab DFlash and DeepSpec DSpark formats (docs/design.md sections 3, 5, 6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockspec.config.common import positive_float, positive_int, read_json, require
from blockspec.config.draft_attention import (DFLASH_ATTENTION_KEYS, DRAFT_LAYER_TYPES, FULL, SLIDING,
                                              read_draft_attention)
from blockspec.config.eagle3 import EAGLE3_ARCHITECTURES
from blockspec.config.rope import RopeConfig
from blockspec.config.target import TargetConfig
from blockspec.errors import BlockspecError

LAYOUTS = ("zlab", "deepspec")
MARKOV_TYPES = ("vanilla", "gated", "rnn")
# DSpark head keys: DeepSpec files put them at top level; SpecForge's DSpark export nests
# them in dflash_config (its configs/qwen3-8b-dspark.json).
DRAFT_HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_DFLASH_CONFIG_READ = {"mask_token_id", "target_layer_ids", "block_size", "mask_token", *DRAFT_HEAD_KEYS,
                       *DFLASH_ATTENTION_KEYS}


def _draft_heads(raw: dict[str, Any], dflash: dict[str, Any], where: str) -> dict[str, Any]:
    """The DSpark head keys of a draft config, top level or nested in dflash_config (None:
    absent). A key given in both places with different values is refused."""
    out: dict[str, Any] = {}
    for key in DRAFT_HEAD_KEYS:
        top, nested = raw.get(key), dflash.get(key)
        require(top is None or nested is None or top == nested,
                 f"{where}: {key} is {top!r} at top level but {nested!r} in dflash_config")
        out[key] = nested if nested is not None else top
    if dflash.get("projector_type") == "dspark":
        # SpecForge's defaults for keys its export leaves out (specforge/modeling/draft/dspark.py):
        # the confidence head exists when trained (confidence_head_alpha > 0) and reads h only.
        if out["enable_confidence_head"] is None:
            alpha = dflash.get("confidence_head_alpha") or 0.0
            require(isinstance(alpha, (int, float)), f"{where}: confidence_head_alpha must be a number")
            out["enable_confidence_head"] = alpha > 0
        if out["confidence_head_with_markov"] is None:
            out["confidence_head_with_markov"] = False
    return out


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash / DSpark draft (docs/design.md sections 3, 5, 6).

    `layout` is "zlab" (block_size B includes the anchor, B-1 drafts) or
    "deepspec" (block_size = gamma drafts). The backbone shares the target's
    hidden size, vocabulary, embedding and lm_head."""

    layout: str
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None
    # The mask token's string, written next to mask_token_id when known: SGLang checks it
    # against the tokenizer when the config names it (docs/serving.md, interop_engines.json).
    mask_token: str | None = None
    # Sliding-window layers (docs/design.md section 3.2): one entry per layer ("full_attention" /
    # "sliding_attention"; empty = all full), the window W (a query at position q sees keys
    # j > q - W) and the causality override (None: sliding layers causal, full layers not).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    causal: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "draft config"
        require(self.layout in LAYOUTS, f"{where}: layout {self.layout!r} must be one of {LAYOUTS}")
        min_block = 2 if self.layout == "zlab" else 1
        require(isinstance(self.block_size, int) and self.block_size >= min_block,
                 f"{where}: block_size must be >= {min_block} for the {self.layout} layout, got {self.block_size!r}")
        for name in ("block_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers", "max_position_embeddings"):
            positive_int(name, getattr(self, name), where)
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        object.__setattr__(self, "rms_norm_eps", positive_float("rms_norm_eps", self.rms_norm_eps, where))
        require(isinstance(self.target_layer_ids, list) and 0 < len(self.target_layer_ids) <= self.num_target_layers
                 and all(isinstance(i, int) and 0 <= i < self.num_target_layers for i in self.target_layer_ids),
                 f"{where}: target_layer_ids {self.target_layer_ids!r} must name layers 0..{self.num_target_layers - 1}")
        require(isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size,
                 f"{where}: mask_token_id {self.mask_token_id!r} is not a token id of a {self.vocab_size}-token vocabulary")
        require(self.markov_head_type in MARKOV_TYPES,
                 f"{where}: markov_head_type {self.markov_head_type!r} must be one of {MARKOV_TYPES}")
        require(isinstance(self.markov_rank, int) and self.markov_rank >= 0, f"{where}: markov_rank must be >= 0")
        if self.markov_rank:
            positive_int("markov_rank", self.markov_rank, where)
        require(self.mask_token is None or (isinstance(self.mask_token, str) and self.mask_token != ""),
                 f"{where}: mask_token must be a non-empty string, got {self.mask_token!r}")
        types = tuple(self.layer_types) or (FULL,) * self.num_hidden_layers
        require(len(types) == self.num_hidden_layers and all(t in DRAFT_LAYER_TYPES for t in types),
                 f"{where}: layer_types must hold {self.num_hidden_layers} entries of {DRAFT_LAYER_TYPES}, got {types!r}")
        object.__setattr__(self, "layer_types", types)
        if SLIDING in types:
            require(isinstance(self.sliding_window, int) and not isinstance(self.sliding_window, bool)
                     and self.sliding_window > 0,
                     f"{where}: sliding_window must be a positive integer, got {self.sliding_window!r}")
        else:
            require(self.sliding_window is None,
                     f"{where}: sliding_window {self.sliding_window!r} needs sliding_attention layers")
        require(self.causal is None or isinstance(self.causal, bool), f"{where}: causal must be true, false or None")
        if self.confidence_temperatures is not None:
            require(len(self.confidence_temperatures) == self.num_drafts
                     and all(t > 0 for t in self.confidence_temperatures),
                     f"{where}: confidence_temperatures must hold {self.num_drafts} positive values")

    @property
    def num_drafts(self) -> int:
        """Draft tokens per round ("num speculative tokens")."""
        return self.block_size - 1 if self.layout == "zlab" else self.block_size

    @property
    def first_draft_slot(self) -> int:
        """Block slot whose output predicts the first draft token."""
        return 1 if self.layout == "zlab" else 0

    def layer_window(self, i: int) -> int | None:
        """Layer i's window (None: full attention)."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def layer_causal(self, i: int) -> bool:
        """Whether layer i's block attends causally (vLLM's and SGLang's rule)."""
        return self.causal if self.causal is not None else self.layer_types[i] == SLIDING

    @property
    def is_windowed(self) -> bool:
        return SLIDING in self.layer_types

    @property
    def window_span(self) -> int:
        """Positions a sliding layer keeps per row: its block's first query (the anchor at p)
        sees context back to p - W + 1 and the block reaches p + block_size - 1."""
        assert self.sliding_window is not None
        return self.sliding_window + self.block_size - 1

    @property
    def is_dspark(self) -> bool:
        return self.markov_rank > 0 or self.enable_confidence_head

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "draft config.json") -> "DraftConfig":
        spec_type = raw.get("speculators_model_type")
        if spec_type is not None:
            raise BlockspecError(
                f"{where}: 'speculators_model_type: {spec_type}' is a speculators-format layout that "
                "blockspec cannot run; convert it to the z-lab (DFlash) or DeepSpec (DSpark) layout")
        archs = raw.get("architectures") or []
        if any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise BlockspecError(f"{where}: {archs[0]} is an EAGLE-3 draft, not a DFlash / DSpark one "
                                 "(EAGLE-3 drafts load with models.checkpoint.load_eagle3)")
        dflash = raw.get("dflash_config") or {}
        require(isinstance(dflash, dict), f"{where}: dflash_config must be an object")
        dspark = _draft_heads(raw, dflash, where)
        layout = raw.get("blockspec_layout")
        if layout is None:
            # z-lab files always carry dflash_config; DeepSpec files put mask_token_id /
            # target_layer_ids at top level (architectures: Qwen3DSparkModel). SpecForge's
            # DSpark export (architectures DSparkDraftModel) nests its heads in dflash_config
            # and trains block slot k to predict anchor + k + 1: the DeepSpec layout.
            if ("markov_rank" in raw or "enable_confidence_head" in raw or any("DSpark" in a for a in archs)
                    or dflash.get("projector_type") == "dspark"
                    or any(k in dflash for k in ("markov_rank", "enable_confidence_head"))):
                layout = "deepspec"
            elif dflash:
                layout = "zlab"
            elif "target_layer_ids" in raw and "mask_token_id" in raw:
                layout = "deepspec"
            else:
                raise BlockspecError(
                    f"{where}: cannot tell the block layout (no dflash_config, no DeepSpec keys); "
                    "refusing to guess, since a wrong layout silently gives tau ~ 1")
        mask_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        require(mask_id is not None, f"{where}: no mask_token_id (expected in dflash_config)")
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        require(layer_ids is not None, f"{where}: no target_layer_ids (expected in dflash_config)")
        require(isinstance(layer_ids, list) and layer_ids and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids),
            f"{where}: target_layer_ids must be a non-empty list of layer indices, got {layer_ids!r}")
        block = raw.get("block_size", dflash.get("block_size"))
        require(block is not None, f"{where}: no block_size")
        mask_token = dflash.get("mask_token", raw.get("mask_token"))
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            require(key in raw, f"{where}: missing required key '{key}'")
        # Bounded before the per-layer lists are read against it (an absurd count is named as such).
        positive_int("num_hidden_layers", raw["num_hidden_layers"], where)
        layer_types, window, causal = read_draft_attention(raw, dflash, raw["num_hidden_layers"], where)
        heads = raw["num_attention_heads"]
        known = {"architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
                 "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "rope_parameters", "max_position_embeddings", "vocab_size", "markov_rank",
                 "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                 "confidence_temperatures", "blockspec_layout", "mask_token_id", "target_layer_ids",
                 "torch_dtype", "dtype", "layer_types", "sliding_window", "tie_word_embeddings", "hidden_act",
                 "attention_bias", "mask_token",
                 "use_sliding_window", "max_window_layers", "is_causal"}
        # dflash_config keys blockspec does not read are kept for the round trip (to_dict).
        dflash_rest = {k: v for k, v in dflash.items() if k not in _DFLASH_CONFIG_READ}
        require(raw.get("hidden_act", "silu") == "silu", f"{where}: only silu draft MLPs are supported")
        require(not raw.get("attention_bias", False), f"{where}: draft attention biases are not supported")
        return cls(
            layout=layout, block_size=block, mask_token_id=mask_id, target_layer_ids=list(layer_ids),
            num_target_layers=raw.get("num_target_layers", max(layer_ids) + 1),
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope=RopeConfig.from_hf(raw, where),
            markov_rank=dspark["markov_rank"] or 0, markov_head_type=dspark["markov_head_type"] or "vanilla",
            enable_confidence_head=bool(dspark["enable_confidence_head"] or False),
            confidence_head_with_markov=bool(True if dspark["confidence_head_with_markov"] is None
                                             else dspark["confidence_head_with_markov"]),
            confidence_temperatures=raw.get("confidence_temperatures"), mask_token=mask_token,
            layer_types=layer_types, sliding_window=window, causal=causal,
            extra={**{k: v for k, v in raw.items() if k not in known},
                   **({"dflash_config": dflash_rest} if dflash_rest else {})},
        )

    @classmethod
    def load(cls, directory: Path) -> "DraftConfig":
        path = Path(directory) / "config.json"
        return cls.from_dict(read_json(path, "draft config"), where=str(path))

    def to_dict(self) -> dict[str, Any]:
        """config.json in the layout's format, with every key vLLM and SGLang read written out
        (src/blockspec/interop_engines.json): an engine's default for a missing key can differ
        from blockspec's (vLLM: confidence_head_with_markov false; SGLang: block_size 16)."""
        extra = dict(self.extra)
        dflash_rest = extra.pop("dflash_config", None) or {}
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": self.block_size,
            "dflash_config": {**dflash_rest, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": self.target_layer_ids},
            "num_target_layers": self.num_target_layers, "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope.theta,
            "rope_scaling": self.rope.to_hf_scaling(), "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "bfloat16",
        }
        # The engines' spellings of the window: transformers' Qwen3Config (which vLLM and SGLang
        # load) drops sliding_window unless use_sliding_window; vLLM reads swa_window_size first.
        attention = {}
        if self.is_windowed:
            out["use_sliding_window"] = True
            attention["swa_window_size"] = self.sliding_window
        if self.causal is not None:
            attention["causal"] = self.causal
        out["dflash_config"].update(attention)
        if self.mask_token is not None:
            out["dflash_config"]["mask_token"] = self.mask_token
        if self.layout == "deepspec":
            # DeepSpec layout: ids at top level, no dflash_config (unless it keeps unread keys).
            del out["dflash_config"]
            out.update(architectures=["Qwen3DSparkModel"], mask_token_id=self.mask_token_id,
                       target_layer_ids=self.target_layer_ids)
            if self.mask_token is not None:
                out["mask_token"] = self.mask_token
            if dflash_rest or attention:
                out["dflash_config"] = {**dflash_rest, **attention}
        if self.layout == "deepspec" or self.is_dspark:
            out.update(markov_rank=self.markov_rank, markov_head_type=self.markov_head_type,
                       enable_confidence_head=self.enable_confidence_head,
                       confidence_head_with_markov=self.confidence_head_with_markov)
            if self.confidence_temperatures is not None:
                out["confidence_temperatures"] = self.confidence_temperatures
        if self.layout == "zlab" and self.is_dspark:
            # Heads on a z-lab block run in blockspec only; name the layout, since head keys
            # alone read as DeepSpec (from_dict).
            out["blockspec_layout"] = "zlab"
        out.update(extra)
        return out

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a draft that does not fit the target it is paired with."""
        where = "draft/target mismatch"
        require(self.hidden_size == target.hidden_size,
                 f"{where}: draft hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        require(self.vocab_size == target.vocab_size,
                 f"{where}: draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        require(max(self.target_layer_ids) < target.num_hidden_layers,
                 f"{where}: target_layer_ids {self.target_layer_ids} name layers beyond the target's "
                 f"{target.num_hidden_layers}")
        require(self.num_target_layers == target.num_hidden_layers,
                 f"{where}: draft was built for a {self.num_target_layers}-layer target, this one has "
                 f"{target.num_hidden_layers}")
