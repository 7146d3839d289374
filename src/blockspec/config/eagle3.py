"""An EAGLE-3 draft's config, in the `LlamaForCausalLMEagle3` format vLLM and SGLang read
and SpecForge and the EAGLE authors write (docs/design.md section 3.1).

The auxiliary target layers have two spellings that differ by one (read from the engines'
loaders, docs/design.md section 3.1):
- `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang, SpecForge): decoder layer ids
  whose OUTPUTS are used, blockspec's `target_layer_ids` convention (SGLang adds 1 and
  captures that layer's input);
- top-level `eagle_aux_hidden_state_layer_ids` (vLLM): the layer whose INPUT is captured,
  i.e. the output of layer id - 1 (vLLM uses the ids as they are).
Both are written, each in its own convention, so both engines read the same layers; a file
whose two spellings disagree is refused. Without either, both engines take the layers
whose outputs are [1, L/2 - 1, L - 4] of an L-layer target (`default_aux_layer_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockspec.config.common import positive_float, positive_int, read_json, require
from blockspec.config.rope import RopeConfig
from blockspec.config.target import TargetConfig
from blockspec.errors import BlockspecError

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3     # fc reads low, middle and high target layers: 3 x target_hidden_size
_KNOWN = {"architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_parameters", "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size",
          "eagle_config", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "hidden_act",
          "attention_bias", "mlp_bias", "bias", "tie_word_embeddings", "torch_dtype", "dtype", "fc_norm",
          "norm_output"}


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """The layers vLLM and SGLang capture when a draft names none (both: the inputs of layers
    2, L // 2 and L - 3), as outputs of decoder layers; SpecForge trains on the same."""
    ids = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    if len(set(ids)) < NUM_AUX_LAYERS or min(ids) < 0:
        raise BlockspecError(f"EAGLE-3: a {num_target_layers}-layer target has no default auxiliary layers "
                             "(they coincide below 7 layers); name them with --target-layer-ids")
    return ids


def _aux_layer_ids(raw: dict[str, Any], where: str) -> list[int] | None:
    """The auxiliary layers as decoder-layer outputs, from either spelling (module docstring)."""
    eagle = raw.get("eagle_config") or {}
    require(isinstance(eagle, dict), f"{where}: eagle_config must be an object")
    require(eagle.get("use_aux_hidden_state", True) is True,
             f"{where}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 style draft); "
             "only EAGLE-3 drafts (fc over three target layers) are supported")
    nested, top = eagle.get("eagle_aux_hidden_state_layer_ids"), raw.get("eagle_aux_hidden_state_layer_ids")
    for name, value in (("eagle_config.eagle_aux_hidden_state_layer_ids", nested),
                        ("eagle_aux_hidden_state_layer_ids", top)):
        require(value is None or (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                                  for i in value)),
                 f"{where}: {name} must be a list of layer ids, got {value!r}")
    if top is not None:
        require(all(i >= 1 for i in top),
                 f"{where}: eagle_aux_hidden_state_layer_ids {top} names the embedding output (0); "
                 "blockspec captures decoder-layer outputs only")
        from_top = [i - 1 for i in top]
        require(nested is None or nested == from_top,
                 f"{where}: eagle_aux_hidden_state_layer_ids {top} (vLLM: inputs of those layers) and "
                 f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang: outputs) name different "
                 "layers; the engines would read different features")
        return from_top
    return None if nested is None else list(nested)


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft: one Llama decoder layer over [embedding ; fc(three target layers)],
    its own lm_head over a reduced vocabulary (`draft_vocab_size` tokens; the d2t / t2d maps
    live in the weights). `target_layer_ids` None: the engines' default for the target it
    runs with (`aux_layer_ids`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    target_layer_ids: list[int] | None = None
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    norm_before_residual: bool = False     # vLLM reads it; SGLang always takes the residual before hidden_norm
    num_hidden_layers: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "EAGLE-3 draft config"
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "max_position_embeddings"):
            positive_int(name, getattr(self, name), where)
        positive_int("hidden_size", self.target_hidden_size, f"{where} (target_hidden_size)")
        positive_int("vocab_size", self.draft_vocab_size, f"{where} (draft_vocab_size)")
        object.__setattr__(self, "rms_norm_eps", positive_float("rms_norm_eps", self.rms_norm_eps, where))
        require(self.draft_vocab_size <= self.vocab_size,
                 f"{where}: draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        # vLLM stacks layers 1.. as plain decoder layers on the fused residual, SGLang as
        # layers that drop it: only the one-layer draft means the same thing to both.
        require(self.num_hidden_layers == 1,
                 f"{where}: num_hidden_layers must be 1 (vLLM and SGLang run deeper EAGLE-3 drafts "
                 f"differently), got {self.num_hidden_layers!r}")
        ids = self.target_layer_ids
        require(ids is None or (isinstance(ids, list) and len(ids) == NUM_AUX_LAYERS and len(set(ids)) == len(ids)
                                and all(isinstance(i, int) and i >= 0 for i in ids)),
                 f"{where}: the auxiliary layers must be {NUM_AUX_LAYERS} distinct decoder layer ids, got {ids!r}")
        require(isinstance(self.norm_before_residual, bool), f"{where}: norm_before_residual must be true or false")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "EAGLE-3 config.json") -> "Eagle3Config":
        spec_type = raw.get("speculators_model_type")
        if spec_type is not None:
            raise BlockspecError(f"{where}: 'speculators_model_type: {spec_type}' is the speculators layout; "
                                 "convert it to the LlamaForCausalLMEagle3 layout")
        archs = raw.get("architectures") or []
        require(any(a in EAGLE3_ARCHITECTURES for a in archs),
                 f"{where}: architectures {archs} is not an EAGLE-3 draft (expected one of {EAGLE3_ARCHITECTURES})")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            require(key in raw, f"{where}: missing required key '{key}'")
        require(raw.get("hidden_act", "silu") == "silu", f"{where}: only silu MLPs are supported")
        for key in ("attention_bias", "mlp_bias", "bias"):
            require(not raw.get(key, False), f"{where}: '{key}: true' (biases) is not supported")
        require(not raw.get("tie_word_embeddings", False),
                 f"{where}: tie_word_embeddings is true: SGLang would tie the draft's lm_head to its "
                 "embedding and vLLM would not; refusing an ambiguous draft")
        # SpecForge-only options that neither engine reads: such a draft runs wrongly there.
        require(not raw.get("fc_norm", False), f"{where}: fc_norm drafts (SpecForge) are read by neither vLLM "
                 "nor SGLang; not supported")
        require(raw.get("norm_output", True) is True, f"{where}: norm_output false is read by neither vLLM nor "
                 "SGLang; not supported")
        heads = positive_int("num_attention_heads", raw["num_attention_heads"], where)
        hidden = positive_int("hidden_size", raw["hidden_size"], where)
        eagle_rest = {k: v for k, v in (raw.get("eagle_config") or {}).items()
                      if k not in ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state")}
        return cls(
            hidden_size=hidden, intermediate_size=raw["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],   # both engines' default
            target_hidden_size=raw.get("target_hidden_size") or hidden,
            target_layer_ids=_aux_layer_ids(raw, where),
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope=RopeConfig.from_hf(raw, where),
            norm_before_residual=raw.get("norm_before_residual", False),
            num_hidden_layers=raw.get("num_hidden_layers", 1),
            extra={**{k: v for k, v in raw.items() if k not in _KNOWN},
                   **({"eagle_config": eagle_rest} if eagle_rest else {})})

    @classmethod
    def load(cls, directory: Path) -> "Eagle3Config":
        path = Path(directory) / "config.json"
        return cls.from_dict(read_json(path, "EAGLE-3 draft config"), where=str(path))

    def to_dict(self) -> dict[str, Any]:
        """config.json with both spellings of the auxiliary layers (module docstring)."""
        extra = dict(self.extra)
        eagle = {**(extra.pop("eagle_config", None) or {}), "use_aux_hidden_state": True}
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope.theta, "rope_scaling": self.rope.to_hf_scaling(),
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        }
        if self.target_layer_ids is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.target_layer_ids)
            out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in self.target_layer_ids]
        out["eagle_config"] = eagle
        out.update(extra)
        return out

    def aux_layer_ids(self, num_target_layers: int) -> list[int]:
        """The target decoder layers whose outputs feed fc, in ascending order (the engines
        concatenate them in layer order whatever order the config lists)."""
        ids = self.target_layer_ids if self.target_layer_ids is not None else default_aux_layer_ids(num_target_layers)
        return sorted(ids)

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a draft that does not fit the target it is paired with."""
        where = "EAGLE-3 draft/target mismatch"
        require(self.vocab_size == target.vocab_size,
                 f"{where}: draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        require(self.target_hidden_size == target.hidden_size,
                 f"{where}: draft target_hidden_size {self.target_hidden_size} != target hidden_size "
                 f"{target.hidden_size}")
        ids = self.aux_layer_ids(target.num_hidden_layers)
        require(max(ids) < target.num_hidden_layers,
                 f"{where}: auxiliary layers {ids} name layers beyond the target's {target.num_hidden_layers}")


# The largest draft tree a round verifies (its verify forward's width); SGLang's examples stay
# at 64 and a CPU verify forward of more nodes costs more than the tree can win back.
MAX_TREE_TOKENS = 256


@dataclass(frozen=True)
class EagleTree:
    """EAGLE-2's draft tree, as SGLang spells it (docs/design.md section 3.1, "Tree
    drafting"): `num_steps` levels (`--speculative-num-steps`), each expanding the `topk`
    best-scored nodes of the level before into their `topk` most likely children
    (`--speculative-eagle-topk`); of every node drafted, the `num_draft_tokens` - 1 with the
    highest path probability are verified with the anchor in one target forward
    (`--speculative-num-draft-tokens`, which counts the anchor). Its shape (nodes drafted per
    step, nodes verified) is fixed; which nodes fill it is chosen per round and row."""

    topk: int
    num_steps: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("topk", "num_steps", "num_draft_tokens"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"EAGLE-3 tree: {name} must be a positive integer, got {value!r}")
        most = min(self.candidates + 1, MAX_TREE_TOKENS)
        require(2 <= self.num_draft_tokens <= most,
                f"EAGLE-3 tree: num_draft_tokens counts the anchor and the verified drafts: 2..{most} for topk "
                f"{self.topk} and {self.num_steps} steps (at most 1 + the {self.candidates} nodes drafted, and "
                f"{MAX_TREE_TOKENS}), got {self.num_draft_tokens}")

    @property
    def candidates(self) -> int:
        """Nodes drafted per row: topk at the first level, topk x topk at each later one."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def scratch_slots(self) -> int:
        """Draft cache slots the expanded nodes' K/V take after a row's committed ones."""
        return (self.num_steps - 1) * self.topk


# Drafts per round of a chain when none is asked for: the training-time test's 7 steps
# (train --ttt-steps), the depth the draft learned to continue its own predictions to.
DEFAULT_CHAIN_DRAFTS = 7


@dataclass(frozen=True)
class ChainDraftConfig:
    """What decoding reads of an EAGLE-3 draft paired with a target (docs/design.md section
    3.1): the names DraftConfig gives a DFlash draft's run-time shape, so the round, the
    policy, the memory plan and the cost table treat both alike. `num_drafts`: the chain's
    length k (a run-time choice, any k >= 1); `block_size` counts the anchor as well (k + 1,
    as z-lab blocks and SGLang's num_draft_tokens do); `target_layer_ids`: the auxiliary
    layers resolved for the target; `hidden_size`: the width of each captured feature (the
    target's hidden size, as for DFlash); `draft`: the file's config."""

    draft: Eagle3Config
    num_drafts: int
    target_layer_ids: list[int]
    layout: str = "eagle3"
    is_dspark: bool = False
    tree: EagleTree | None = None   # None: a chain; else the tree drafted (num_drafts: its verified drafts)

    def __post_init__(self) -> None:
        require(isinstance(self.num_drafts, int) and not isinstance(self.num_drafts, bool) and self.num_drafts >= 1,
                f"EAGLE-3: drafts per round must be a positive integer, got {self.num_drafts!r}")
        require(self.tree is None or self.num_drafts == self.tree.num_draft_tokens - 1,
                f"EAGLE-3: a tree verifies num_draft_tokens - 1 drafts per round, not {self.num_drafts}")

    @classmethod
    def of(cls, draft: Eagle3Config, num_target_layers: int, num_drafts: int = DEFAULT_CHAIN_DRAFTS
           ) -> "ChainDraftConfig":
        return cls(draft, num_drafts, draft.aux_layer_ids(num_target_layers))

    @property
    def block_size(self) -> int:
        return self.num_drafts + 1

    def layer_window(self, i: int) -> None:
        """EAGLE-3 layers attend to the whole context (no sliding-window layers)."""
        return None

    @property
    def hidden_size(self) -> int:
        return self.draft.target_hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self.draft.num_hidden_layers

    @property
    def num_key_value_heads(self) -> int:
        return self.draft.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.draft.head_dim

    def check_target(self, target: TargetConfig) -> None:
        self.draft.check_target(target)

    def signature(self) -> str:
        """The shape a draft round's cost depends on (cost-table cache keys)."""
        d = self.draft
        tree = "" if self.tree is None else f" tree={self.tree.topk}x{self.tree.num_steps}"
        return (f"eagle3 hidden={d.hidden_size} inter={d.intermediate_size} heads={d.num_attention_heads}/"
                f"{d.num_key_value_heads} head_dim={d.head_dim} draft_vocab={d.draft_vocab_size} "
                f"drafts={self.num_drafts}{tree} taps={self.target_layer_ids}")
