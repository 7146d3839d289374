"""The target model's config: a Hugging Face `config.json` (Qwen3 / Llama / Qwen2 / Mistral)."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field, fields
from pathlib import Path
from typing import Any

from blockspec.config.common import check_model_type, positive_float, positive_int, read_json, require
from blockspec.config.rope import RopeConfig

def _sliding_window(raw: dict[str, Any], model_type: str, where: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layers) as transformers reads them: Mistral slides every layer
    when `sliding_window` is set; Qwen2 / Qwen3 only with `use_sliding_window`, in the
    layers `layer_types` marks (default: layers >= max_window_layers); Llama never."""
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    if model_type == "mistral":
        layers = tuple(range(n)) if window is not None else ()
    elif model_type in ("qwen2", "qwen3"):
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
        layer_types = raw.get("layer_types")
        if window is None:  # transformers: no window, every layer full whatever layer_types says
            layers = ()
        elif layer_types is None:
            first = raw.get("max_window_layers", 28)
            require(isinstance(first, int), f"{where}: max_window_layers must be an integer, got {first!r}")
            layers = tuple(i for i in range(n) if i >= first)
        else:
            require(isinstance(layer_types, list) and len(layer_types) == n
                     and all(t in ("full_attention", "sliding_attention") for t in layer_types),
                     f"{where}: layer_types must list 'full_attention' / 'sliding_attention' for each of "
                     f"the {n} layers, got {layer_types!r}")
            layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    else:
        window, layers = None, ()
    if window is not None:
        positive_int("sliding_window", window, where)
        if not layers:
            window = None
    return window, layers


@dataclass(frozen=True)
class TargetConfig:
    """Architecture of a target decoder, from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    # Sliding-window attention: a query at position i sees keys j with i - j < window
    # (transformers' sliding_window_overlay) in the layers listed; None: every layer full.
    attention_window: int | None = None
    window_layers: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    where: InitVar[str] = "target config"

    def __post_init__(self, where: str) -> None:
        check_model_type(self.model_type, where)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            positive_int(name, getattr(self, name), where)
        object.__setattr__(self, "rms_norm_eps", positive_float("rms_norm_eps", self.rms_norm_eps, where))
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        require(heads % kv_heads == 0,
                 f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        require(self.head_dim % 2 == 0, f"{where}: head_dim must be even for rotary embeddings")
        self.rope.check_head_dim(self.head_dim, where)
        if self.attention_window is not None:
            positive_int("sliding_window", self.attention_window, where)
        object.__setattr__(self, "window_layers", tuple(self.window_layers))
        require(all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in self.window_layers),
                 f"{where}: sliding-window layers {self.window_layers} must be in 0..{self.num_hidden_layers - 1}")
        require((self.attention_window is None) == (not self.window_layers),
                 f"{where}: a sliding window needs the layers it applies to, and layers need a window")

    @property
    def supported_length(self) -> int:
        """The longest sequence the model's RoPE supports (vLLM's derivation: scaled by
        the yarn / linear / dynamic factor)."""
        return self.rope.max_positions(self.max_position_embeddings)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> "TargetConfig":
        model_type = raw.get("model_type")
        check_model_type(model_type, where)  # first: an unsupported family also lacks our keys
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            require(key in raw, f"{where}: missing required key '{key}'")
            positive_int(key, raw[key], where)
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        act = raw.get("hidden_act", "silu")
        require(act == "silu", f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        window, window_layers = _sliding_window(raw, model_type, where)
        eos = raw.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        require(not raw.get("mlp_bias", False), f"{where}: mlp_bias is not supported")
        known = {f.name for f in fields(cls)} | {
            "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "hidden_act", "mlp_bias"}
        return cls(
            model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope=RopeConfig.from_hf(raw, where),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"), eos_token_id=eos_list,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            attention_window=window, window_layers=window_layers,
            extra={k: v for k, v in raw.items() if k not in known}, where=where,
        )

    @classmethod
    def load(cls, directory: Path) -> "TargetConfig":
        path = Path(directory) / "config.json"
        return cls.from_dict(read_json(path, "target config"), where=str(path))

    def to_dict(self) -> dict[str, Any]:
        arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[self.model_type]
        out: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta, "rope_scaling": self.rope.to_hf_scaling(),
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.attention_window is not None:  # a config read from a file keeps its own keys (extra)
            out["sliding_window"] = self.attention_window
            if self.model_type != "mistral":
                out["use_sliding_window"] = True
                out["layer_types"] = ["sliding_attention" if i in self.window_layers else "full_attention"
                                      for i in range(self.num_hidden_layers)]
        out.update(self.extra)
        return out

    def default_layer_ids(self, num_draft_layers: int) -> list[int]:
        """docs/design.md section 2: which target layers feed an N-layer draft."""
        t = self.num_hidden_layers
        if num_draft_layers == 1:
            return [t // 2]
        return [int(math.floor(1 + i * (t - 4) / (num_draft_layers - 1) + 0.5))
                for i in range(num_draft_layers)]


# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): dividing logits by a
# subnormal temperature overflows them to inf and the softmax to NaN.
