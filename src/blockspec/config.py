"""Configuration dataclasses, validated on construction.

`TargetConfig` reads a Hugging Face `config.json` (Qwen3 / Llama / Qwen2);
`DraftConfig` reads a z-lab DFlash or DeepSpec DSpark draft config;
`SamplingParams` holds per-request decoding settings. Unknown keys of a config
file are kept in `extra` so that a load -> save round trip loses nothing.

Every config is a frozen value, validated when it is built: a changed setting
(a shorter draft block, say) is a new value made with `dataclasses.replace`.
"""

from __future__ import annotations

import json
import math
from dataclasses import InitVar, dataclass, field, fields
from pathlib import Path
from typing import Any

from blockspec.errors import BlockspecError

SUPPORTED_TARGET_TYPES = ("qwen3", "llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# Decoding methods: plain AR, DFlash drafts, DSpark drafts (docs/design.md sections 3 and 5).
DRAFT_METHODS = ("dflash", "dspark")
METHODS = ("ar", *DRAFT_METHODS)
# Verification rules (docs/design.md section 4): lossless rejection sampling, sample-and-match.
RULES = ("rejection", "match")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object from `path`, raising BlockspecError naming `what` on any failure."""
    path = Path(path)
    if not path.is_file():
        raise BlockspecError(f"{what}: {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BlockspecError(f"{what}: {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BlockspecError(f"{what}: {path} must hold a JSON object")
    return data


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise BlockspecError(msg)


# Upper bounds far above any released model (Llama-3.1-405B: 126 layers, hidden 16384,
# intermediate 53248; Gemma: 262k vocabulary; Llama 4: 10M context), so a config asking
# for more is corrupt or hostile: refused by name before anything is sized or allocated.
LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
          "num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
          "head_dim": 4096, "max_position_embeddings": 1 << 26, "num_target_layers": 4096,
          "block_size": 1024, "markov_rank": 1 << 16}


def _positive_int(name: str, value: Any, where: str) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{where}: '{name}' must be a positive integer, got {value!r}")
    limit = LIMITS.get(name)
    _require(limit is None or value <= limit,
             f"{where}: '{name}' = {value} is absurd (the limit is {limit}); the config is corrupt")
    return value


def _check_model_type(model_type: Any, where: str) -> None:
    _require(model_type in SUPPORTED_TARGET_TYPES,
             f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TARGET_TYPES)})")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (neox style), as transformers' `rope_parameters`.

    Types (transformers' modeling_rope_utils): default, linear (positions / factor),
    dynamic (NTK: the base grows with the sequence length beyond
    max_position_embeddings), yarn (NTK-by-parts + attention_factor on cos/sin),
    llama3 (frequency-dependent), longrope (short / long per-frequency factors,
    chosen by the sequence length). `max_position_embeddings` is the model's
    (dynamic and longrope read it)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    where: InitVar[str] = "rope config"

    def __post_init__(self, where: str) -> None:
        _require(self.rope_type in SUPPORTED_ROPE_TYPES,
                 f"{where}: rope type '{self.rope_type}' is not supported "
                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        _require(isinstance(self.theta, (int, float)) and self.theta > 0, f"{where}: rope_theta must be > 0")
        object.__setattr__(self, "theta", float(self.theta))
        if self.rope_type != "default":
            _require(isinstance(self.factor, (int, float)) and self.factor > 0,
                     f"{where}: rope factor must be > 0 for rope type '{self.rope_type}', got {self.factor!r}")
        if self.rope_type in ("llama3", "yarn", "longrope"):
            _positive_int("original_max_position_embeddings", self.original_max_position_embeddings, where)
        if self.rope_type == "llama3":
            _require(self.high_freq_factor != self.low_freq_factor,
                     f"{where}: llama3 rope needs high_freq_factor != low_freq_factor")
        if self.rope_type == "dynamic":
            _require(self.max_position_embeddings is not None,
                     f"{where}: dynamic rope needs max_position_embeddings")
        if self.rope_type == "longrope":
            _require(self.short_factor is not None and self.long_factor is not None,
                     f"{where}: longrope needs short_factor and long_factor lists")
            _require(self.max_position_embeddings is not None,
                     f"{where}: longrope needs max_position_embeddings")
            for name in ("short_factor", "long_factor"):
                object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

    @property
    def length_dependent(self) -> bool:
        """True when a token's rotation depends on the sequence length it was run with
        (dynamic, longrope), not on its position alone."""
        return self.rope_type in ("dynamic", "longrope")

    def check_head_dim(self, head_dim: int, where: str) -> None:
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                _require(len(getattr(self, name)) == head_dim // 2,
                         f"{where}: longrope {name} must hold head_dim/2 = {head_dim // 2} values, "
                         f"got {len(getattr(self, name))}")
        if self.rope_type == "dynamic":
            _require(head_dim > 2, f"{where}: dynamic rope needs head_dim > 2")

    def max_positions(self, max_position_embeddings: int) -> int:
        """Positions the scaled RoPE supports, as vLLM derives a model's length: yarn
        original_max_position_embeddings x factor; linear and dynamic
        max_position_embeddings x factor; otherwise max_position_embeddings."""
        if self.rope_type == "yarn":
            return int(self.original_max_position_embeddings * self.factor)
        if self.rope_type in ("linear", "dynamic"):
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older
        # files write `rope_theta` plus an optional `rope_scaling` dict. Defaults and
        # key precedence follow transformers' standardize_rope_params and the
        # _compute_*_parameters functions.
        params = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(params, dict) or not isinstance(scaling, dict):
            raise BlockspecError(f"{where}: rope_parameters / rope_scaling must be objects")
        merged = {**params, **scaling}
        if any(isinstance(v, dict) for v in merged.values()):
            raise BlockspecError(f"{where}: per-layer-type rope parameters are not supported")
        theta = raw.get("rope_theta", merged.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:  # before reading its keys: name the type
            raise BlockspecError(f"{where}: rope type '{rope_type}' is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        _require(partial in (None, 1, 1.0), f"{where}: partial_rotary_factor {partial!r} is not supported")
        max_pos = raw.get("max_position_embeddings", 2048)
        # transformers: a top-level original_max_position_embeddings wins, then the rope
        # dict's, then max_position_embeddings.
        original = raw.get("original_max_position_embeddings") or merged.get("original_max_position_embeddings") \
            or max_pos
        factor = merged.get("factor")
        if factor is None:
            # yarn / longrope without a factor: the ratio of the two lengths (transformers).
            factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0
        _require(isinstance(factor, (int, float)) and not isinstance(factor, bool),
                 f"{where}: rope factor must be a number, got {factor!r}")

        def number(key: str, default: float | None) -> float | None:
            value = merged.get(key)
            if value is None:
                return default
            _require(isinstance(value, (int, float)) and not isinstance(value, bool),
                     f"{where}: rope {key} must be a number, got {value!r}")
            return float(value)

        return cls(
            theta=theta, rope_type=rope_type, factor=float(factor),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            # only the types that read them carry the lengths (others keep the defaults, so a
            # config equals its round trip)
            original_max_position_embeddings=int(original) if rope_type in ("llama3", "yarn", "longrope") else 8192,
            max_position_embeddings=int(max_pos) if rope_type in ("dynamic", "longrope") else None,
            attention_factor=number("attention_factor", None),
            # transformers: `beta_fast or 32`, `beta_slow or 1` (0 / None mean the default)
            beta_fast=number("beta_fast", None) or 32.0, beta_slow=number("beta_slow", None) or 1.0,
            mscale=number("mscale", None), mscale_all_dim=number("mscale_all_dim", None),
            truncate=bool(merged.get("truncate", True)),
            short_factor=merged.get("short_factor"), long_factor=merged.get("long_factor"),
            where=where,
        )

    def to_hf_scaling(self) -> dict[str, Any] | None:
        if self.rope_type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        elif self.rope_type == "yarn":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        elif self.rope_type == "longrope":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       short_factor=list(self.short_factor or ()), long_factor=list(self.long_factor or ()))
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out


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
            _require(isinstance(first, int), f"{where}: max_window_layers must be an integer, got {first!r}")
            layers = tuple(i for i in range(n) if i >= first)
        else:
            _require(isinstance(layer_types, list) and len(layer_types) == n
                     and all(t in ("full_attention", "sliding_attention") for t in layer_types),
                     f"{where}: layer_types must list 'full_attention' / 'sliding_attention' for each of "
                     f"the {n} layers, got {layer_types!r}")
            layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    else:
        window, layers = None, ()
    if window is not None:
        _positive_int("sliding_window", window, where)
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
        _check_model_type(self.model_type, where)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name), where)
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        _require(heads % kv_heads == 0,
                 f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        _require(self.head_dim % 2 == 0, f"{where}: head_dim must be even for rotary embeddings")
        self.rope.check_head_dim(self.head_dim, where)
        if self.attention_window is not None:
            _positive_int("sliding_window", self.attention_window, where)
        object.__setattr__(self, "window_layers", tuple(self.window_layers))
        _require(all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in self.window_layers),
                 f"{where}: sliding-window layers {self.window_layers} must be in 0..{self.num_hidden_layers - 1}")
        _require((self.attention_window is None) == (not self.window_layers),
                 f"{where}: a sliding window needs the layers it applies to, and layers need a window")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: full attention)."""
        return self.attention_window if layer in self.window_layers else None

    @property
    def supported_length(self) -> int:
        """The longest sequence the model's RoPE supports (vLLM's derivation: scaled by
        the yarn / linear / dynamic factor)."""
        return self.rope.max_positions(self.max_position_embeddings)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> "TargetConfig":
        model_type = raw.get("model_type")
        _check_model_type(model_type, where)  # first: an unsupported family also lacks our keys
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            _require(key in raw, f"{where}: missing required key '{key}'")
            _positive_int(key, raw[key], where)
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        act = raw.get("hidden_act", "silu")
        _require(act == "silu", f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        window, window_layers = _sliding_window(raw, model_type, where)
        eos = raw.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        _require(not raw.get("mlp_bias", False), f"{where}: mlp_bias is not supported")
        known = {f.name for f in fields(cls)} | {
            "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "hidden_act", "mlp_bias"}
        return cls(
            model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf(raw, where),
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
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature == 0 means greedy; a temperature in
    (0, SAMPLING_EPS = 1e-5) is normalised to 0.0 (greedy) on construction, as vLLM does,
    so every path (AR and speculative) decodes it greedily instead of overflowing."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                 and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        _require(isinstance(self.top_k, int) and 0 <= self.top_k < 2**31,
                 f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        # A top_p below float32 resolution would drop every token.
        _require(isinstance(self.top_p, (int, float)) and 1e-6 <= self.top_p <= 1,
                 f"top_p must be in (0, 1] (and >= 1e-6), got {self.top_p!r}")
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0,
                 f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        _require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
                 f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        _require(isinstance(self.stop_token_ids, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse stop_token_ids the model can never produce (ids >= vocab_size): such a
        stop would silently never fire."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _require(not bad, f"stop_token_ids {bad[:8]} are outside the vocabulary (token ids 0..{vocab_size - 1})")


# generation_config.json keys that become request defaults (as vLLM's default
# `--generation-config auto`): HF name -> SamplingParams field.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "max_new_tokens": "max_new_tokens"}
# Sampling settings blockspec does not implement: reported (never silently dropped).
UNSUPPORTED_GENERATION_KEYS = ("repetition_penalty", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                               "no_repeat_ngram_size", "presence_penalty", "frequency_penalty")
# The value of such a key that changes nothing (0 unless listed).
_NEUTRAL = {"repetition_penalty": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's `generation_config.json`, honoured like vLLM's default
    (`--generation-config auto`): its `eos_token_id` (int or list) joins the model's stop
    ids, and its temperature / top_p / top_k / max_new_tokens become the defaults of a
    request, which the request's own values override. `do_sample` is not consulted (as in
    vLLM); keys blockspec does not implement (repetition_penalty, min_p, ...) are listed
    in `unsupported` for the caller to report. A missing file means no defaults."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    eos_token_id: tuple[int, ...] = ()
    unsupported: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "generation_config.json") -> "GenerationDefaults":
        values: dict[str, Any] = {}
        for key, name in GENERATION_DEFAULT_KEYS.items():
            if raw.get(key) is not None:
                values[name] = raw[key]
        if isinstance(values.get("top_k"), int) and values["top_k"] < 0:
            values["top_k"] = 0  # HF / vLLM spell "off" as 0 or -1; blockspec as 0
        try:  # the values must make a valid request on their own
            SamplingParams(**values)
        except BlockspecError as exc:
            raise BlockspecError(f"{where}: {exc}") from None
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
        _require(isinstance(eos_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in eos_ids),
                 f"{where}: eos_token_id must be a token id or a list of them, got {eos!r}")
        unsupported = tuple(k for k in UNSUPPORTED_GENERATION_KEYS
                            if raw.get(k) is not None and raw[k] != _NEUTRAL.get(k, 0))
        return cls(eos_token_id=tuple(eos_ids), unsupported=unsupported, **values)

    @classmethod
    def load(cls, directory: Path) -> "GenerationDefaults":
        path = Path(directory) / "generation_config.json"
        if not path.is_file():
            return cls()
        return cls.from_dict(read_json(path, "generation config"), where=str(path))

    def sampling_params(self, **request: Any) -> SamplingParams:
        """SamplingParams of a request: its own values (None = not given) over these defaults."""
        values = {name: getattr(self, name) for name in GENERATION_DEFAULT_KEYS.values()
                  if getattr(self, name) is not None}
        values.update({k: v for k, v in request.items() if v is not None})
        return SamplingParams(**values)



LAYOUTS = ("zlab", "deepspec")
MARKOV_TYPES = ("vanilla", "gated", "rnn")
# DSpark head keys: DeepSpec files put them at top level; SpecForge's DSpark export nests
# them in dflash_config (its configs/qwen3-8b-dspark.json).
DRAFT_HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_DFLASH_CONFIG_READ = {"mask_token_id", "target_layer_ids", "block_size", "mask_token", *DRAFT_HEAD_KEYS}


def _draft_heads(raw: dict[str, Any], dflash: dict[str, Any], where: str) -> dict[str, Any]:
    """The DSpark head keys of a draft config, top level or nested in dflash_config (None:
    absent). A key given in both places with different values is refused."""
    out: dict[str, Any] = {}
    for key in DRAFT_HEAD_KEYS:
        top, nested = raw.get(key), dflash.get(key)
        _require(top is None or nested is None or top == nested,
                 f"{where}: {key} is {top!r} at top level but {nested!r} in dflash_config")
        out[key] = nested if nested is not None else top
    if dflash.get("projector_type") == "dspark":
        # SpecForge's defaults for keys its export leaves out (specforge/modeling/draft/dspark.py):
        # the confidence head exists when trained (confidence_head_alpha > 0) and reads h only.
        if out["enable_confidence_head"] is None:
            alpha = dflash.get("confidence_head_alpha") or 0.0
            _require(isinstance(alpha, (int, float)), f"{where}: confidence_head_alpha must be a number")
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
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "draft config"
        _require(self.layout in LAYOUTS, f"{where}: layout {self.layout!r} must be one of {LAYOUTS}")
        min_block = 2 if self.layout == "zlab" else 1
        _require(isinstance(self.block_size, int) and self.block_size >= min_block,
                 f"{where}: block_size must be >= {min_block} for the {self.layout} layout, got {self.block_size!r}")
        for name in ("block_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers", "max_position_embeddings"):
            _positive_int(name, getattr(self, name), where)
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        _require(isinstance(self.target_layer_ids, list) and 0 < len(self.target_layer_ids) <= self.num_target_layers
                 and all(isinstance(i, int) and 0 <= i < self.num_target_layers for i in self.target_layer_ids),
                 f"{where}: target_layer_ids {self.target_layer_ids!r} must name layers 0..{self.num_target_layers - 1}")
        _require(isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size,
                 f"{where}: mask_token_id {self.mask_token_id!r} is not a token id of a {self.vocab_size}-token vocabulary")
        _require(self.markov_head_type in MARKOV_TYPES,
                 f"{where}: markov_head_type {self.markov_head_type!r} must be one of {MARKOV_TYPES}")
        _require(isinstance(self.markov_rank, int) and self.markov_rank >= 0, f"{where}: markov_rank must be >= 0")
        if self.markov_rank:
            _positive_int("markov_rank", self.markov_rank, where)
        _require(self.mask_token is None or (isinstance(self.mask_token, str) and self.mask_token != ""),
                 f"{where}: mask_token must be a non-empty string, got {self.mask_token!r}")
        if self.confidence_temperatures is not None:
            _require(len(self.confidence_temperatures) == self.num_drafts
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
        dflash = raw.get("dflash_config") or {}
        _require(isinstance(dflash, dict), f"{where}: dflash_config must be an object")
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
        _require(mask_id is not None, f"{where}: no mask_token_id (expected in dflash_config)")
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        _require(layer_ids is not None, f"{where}: no target_layer_ids (expected in dflash_config)")
        block = raw.get("block_size", dflash.get("block_size"))
        _require(block is not None, f"{where}: no block_size")
        mask_token = dflash.get("mask_token", raw.get("mask_token"))
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            _require(key in raw, f"{where}: missing required key '{key}'")
        layer_types = raw.get("layer_types") or []
        _require(all(t == "full_attention" for t in layer_types),
                 f"{where}: sliding-window draft layers ({layer_types}) are not supported; "
                 "only full_attention draft layers can run")
        heads = raw["num_attention_heads"]
        known = {"architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
                 "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "rope_parameters", "max_position_embeddings", "vocab_size", "markov_rank",
                 "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                 "confidence_temperatures", "blockspec_layout", "mask_token_id", "target_layer_ids",
                 "torch_dtype", "dtype", "layer_types", "sliding_window", "tie_word_embeddings", "hidden_act",
                 "attention_bias", "mask_token"}
        # dflash_config keys blockspec does not read are kept for the round trip (to_dict).
        dflash_rest = {k: v for k, v in dflash.items() if k not in _DFLASH_CONFIG_READ}
        _require(raw.get("hidden_act", "silu") == "silu", f"{where}: only silu draft MLPs are supported")
        _require(not raw.get("attention_bias", False), f"{where}: draft attention biases are not supported")
        return cls(
            layout=layout, block_size=block, mask_token_id=mask_id, target_layer_ids=list(layer_ids),
            num_target_layers=raw.get("num_target_layers", max(layer_ids) + 1),
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf(raw, where),
            markov_rank=dspark["markov_rank"] or 0, markov_head_type=dspark["markov_head_type"] or "vanilla",
            enable_confidence_head=bool(dspark["enable_confidence_head"] or False),
            confidence_head_with_markov=bool(True if dspark["confidence_head_with_markov"] is None
                                             else dspark["confidence_head_with_markov"]),
            confidence_temperatures=raw.get("confidence_temperatures"), mask_token=mask_token,
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
            "vocab_size": self.vocab_size, "layer_types": ["full_attention"] * self.num_hidden_layers,
            "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "bfloat16",
        }
        if self.mask_token is not None:
            out["dflash_config"]["mask_token"] = self.mask_token
        if self.layout == "deepspec":
            # DeepSpec layout: ids at top level, no dflash_config (unless it keeps unread keys).
            del out["dflash_config"]
            out.update(architectures=["Qwen3DSparkModel"], mask_token_id=self.mask_token_id,
                       target_layer_ids=self.target_layer_ids)
            if self.mask_token is not None:
                out["mask_token"] = self.mask_token
            if dflash_rest:
                out["dflash_config"] = dflash_rest
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
        _require(self.hidden_size == target.hidden_size,
                 f"{where}: draft hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        _require(self.vocab_size == target.vocab_size,
                 f"{where}: draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        _require(max(self.target_layer_ids) < target.num_hidden_layers,
                 f"{where}: target_layer_ids {self.target_layer_ids} name layers beyond the target's "
                 f"{target.num_hidden_layers}")
        _require(self.num_target_layers == target.num_hidden_layers,
                 f"{where}: draft was built for a {self.num_target_layers}-layer target, this one has "
                 f"{target.num_hidden_layers}")
