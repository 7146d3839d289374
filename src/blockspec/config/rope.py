"""Rotary-embedding parameters read from a Hugging Face config (docs/design.md section 2)."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import Any

from blockspec.config.common import SUPPORTED_ROPE_TYPES, positive_int, require
from blockspec.errors import BlockspecError

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
        require(self.rope_type in SUPPORTED_ROPE_TYPES,
                 f"{where}: rope type '{self.rope_type}' is not supported "
                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        require(isinstance(self.theta, (int, float)) and self.theta > 0, f"{where}: rope_theta must be > 0")
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
                     "beta_slow", "mscale", "mscale_all_dim"):
            value = getattr(self, name)   # JSON's Infinity / NaN / 1e999 parse as floats
            require(value is None or (isinstance(value, (int, float)) and math.isfinite(value)),
                     f"{where}: rope {name} must be a finite number, got {value!r}")
        object.__setattr__(self, "theta", float(self.theta))
        if self.rope_type != "default":
            require(isinstance(self.factor, (int, float)) and self.factor > 0,
                     f"{where}: rope factor must be > 0 for rope type '{self.rope_type}', got {self.factor!r}")
        if self.rope_type in ("llama3", "yarn", "longrope"):
            positive_int("original_max_position_embeddings", self.original_max_position_embeddings, where)
        if self.rope_type == "llama3":
            require(self.high_freq_factor != self.low_freq_factor,
                     f"{where}: llama3 rope needs high_freq_factor != low_freq_factor")
        if self.rope_type == "dynamic":
            require(self.max_position_embeddings is not None,
                     f"{where}: dynamic rope needs max_position_embeddings")
        if self.rope_type == "longrope":
            require(self.short_factor is not None and self.long_factor is not None,
                     f"{where}: longrope needs short_factor and long_factor lists")
            require(self.max_position_embeddings is not None,
                     f"{where}: longrope needs max_position_embeddings")
            for name in ("short_factor", "long_factor"):
                values = getattr(self, name)
                require(isinstance(values, (list, tuple)) and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in values),
                    f"{where}: longrope {name} must be a list of finite numbers")
                object.__setattr__(self, name, tuple(float(x) for x in values))

    @property
    def length_dependent(self) -> bool:
        """True when a token's rotation depends on the sequence length it was run with
        (dynamic, longrope), not on its position alone."""
        return self.rope_type in ("dynamic", "longrope")

    def check_head_dim(self, head_dim: int, where: str) -> None:
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                require(len(getattr(self, name)) == head_dim // 2,
                         f"{where}: longrope {name} must hold head_dim/2 = {head_dim // 2} values, "
                         f"got {len(getattr(self, name))}")
        if self.rope_type == "dynamic":
            require(head_dim > 2, f"{where}: dynamic rope needs head_dim > 2")

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
        require(partial in (None, 1, 1.0), f"{where}: partial_rotary_factor {partial!r} is not supported")
        max_pos = raw.get("max_position_embeddings", 2048)
        # transformers: a top-level original_max_position_embeddings wins, then the rope
        # dict's, then max_position_embeddings.
        original = raw.get("original_max_position_embeddings") or merged.get("original_max_position_embeddings") \
            or max_pos
        factor = merged.get("factor")
        if factor is None:
            # yarn / longrope without a factor: the ratio of the two lengths (transformers).
            factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0
        require(isinstance(factor, (int, float)) and not isinstance(factor, bool),
                 f"{where}: rope factor must be a number, got {factor!r}")

        def number(key: str, default: float | None) -> float | None:
            value = merged.get(key)
            if value is None:
                return default
            require(isinstance(value, (int, float)) and not isinstance(value, bool),
                     f"{where}: rope {key} must be a number, got {value!r}")
            return float(value)

        return cls(
            theta=theta, rope_type=rope_type, factor=float(factor),
            low_freq_factor=number("low_freq_factor", 1.0), high_freq_factor=number("high_freq_factor", 4.0),
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
