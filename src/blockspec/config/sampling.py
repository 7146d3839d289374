"""Per-request decoding settings and the defaults a checkpoint's generation_config.json sets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockspec.config.common import read_json, require
from blockspec.errors import BlockspecError

SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
MIN_TOP_P = 1e-6   # vLLM's default --max-logprobs, and OpenAI's top_logprobs limit
# Upper edges (inclusive) of the sampled temperature bands; band 0 is greedy. Acceptance
# falls steeply with temperature, so the drafting policy learns each band apart: a mix of
# greedy and sampled requests must not make greedy rows stop drafting.
TEMPERATURE_BANDS = (0.5, 1.0)


def temperature_band(temperature: float) -> int:
    """0 for greedy, then 1, 2, ... for temperatures up to each TEMPERATURE_BANDS edge, and one past them."""
    if temperature < SAMPLING_EPS:
        return 0
    return 1 + sum(temperature > edge for edge in TEMPERATURE_BANDS)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
    # The target's log-probabilities to return (vLLM's meaning): None = none; n >= 0 = the
    # emitted token's plus the n most likely at each position (of the prompt's tokens too
    # for prompt_logprobs). Raw: before penalties, temperature and top-k/top-p, as vLLM's
    # default --logprobs-mode raw_logprobs.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Applied to the target's logits before verification (so speculation stays exact), in
    # vLLM's order: logit_bias, repetition (prompt and output tokens), frequency, presence
    # (output tokens); min_p after temperature.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                 and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        require(_is_int(self.top_k) and -1 <= self.top_k < 2**31,
                 f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if self.top_k == -1:   # vLLM's and HF's other spelling of "off"
            object.__setattr__(self, "top_k", 0)
        require(_is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < MIN_TOP_P:   # same result (the top token always holds more than 1e-6 of the
            object.__setattr__(self, "top_p", MIN_TOP_P)   # mass); below float32 resolution none would stay
        require(isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0,
                 f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
                 f"seed must be a signed 64-bit integer, got {self.seed!r}")
        require(isinstance(self.stop_token_ids, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        self._check_logits_options()

    def _check_logits_options(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                     f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_real(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        require(_is_real(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
                 f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        require(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        require(isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()),
            f"logit_bias must map token ids (integers >= 0) to biases in [-100, 100], got {self.logit_bias!r}")

    @property
    def penalized(self) -> bool:
        """Whether the target's logits are changed before sampling (penalties, logit_bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def band(self) -> int:
        """The temperature band whose acceptance the drafting policy learns for this request."""
        return temperature_band(self.temperature)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse stop_token_ids the model can never produce (ids >= vocab_size): such a
        stop would silently never fire."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            bad = [t for t in ids if t >= vocab_size]
            require(not bad, f"{name} {bad[:8]} are outside the vocabulary (token ids 0..{vocab_size - 1})")


# generation_config.json keys that become request defaults (as vLLM's default
# `--generation-config auto`): HF name -> SamplingParams field.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "max_new_tokens": "max_new_tokens", "repetition_penalty": "repetition_penalty",
                           "min_p": "min_p"}
# Sampling settings blockspec does not implement: reported (never silently dropped).
UNSUPPORTED_GENERATION_KEYS = ("typical_p", "epsilon_cutoff", "eta_cutoff",
                               "no_repeat_ngram_size", "presence_penalty", "frequency_penalty")
# The value of such a key that changes nothing (0 unless listed).
_NEUTRAL = {"typical_p": 1.0, "epsilon_cutoff": 0.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's `generation_config.json`, honoured like vLLM's default
    (`--generation-config auto`): its `eos_token_id` (int or list) joins the model's stop
    ids, and its temperature / top_p / top_k / min_p / repetition_penalty / max_new_tokens
    become the defaults of a
    request, which the request's own values override. `do_sample` is not consulted (as in
    vLLM); keys blockspec does not implement (typical_p, epsilon_cutoff, ...) are listed
    in `unsupported` for the caller to report. A missing file means no defaults."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    eos_token_id: tuple[int, ...] = ()
    unsupported: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "generation_config.json") -> "GenerationDefaults":
        values: dict[str, Any] = {}
        for key, name in GENERATION_DEFAULT_KEYS.items():
            if raw.get(key) is not None:
                values[name] = raw[key]
        if isinstance(values.get("top_k"), int) and values["top_k"] < 0:
            values["top_k"] = 0  # HF / vLLM spell "off" as 0 or -1 (and HF any negative)
        try:  # the values must make a valid request on their own
            SamplingParams(**values)
        except BlockspecError as exc:
            raise BlockspecError(f"{where}: {exc}") from None
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
        require(isinstance(eos_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
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
