"""Which draft layers attend through a sliding window, and causally: the keys of a DFlash /
DSpark draft config as vLLM (`qwen3_dflash.py`) and SGLang (`models/dflash.py`,
`dflash_utils.py`) read them (docs/design.md section 3.2).

- `layer_types`: "full_attention" / "sliding_attention" per draft layer. Without it, a
  Qwen3-style config with `use_sliding_window` slides the layers >= `max_window_layers`
  (transformers' default, which both engines see), and vLLM's `dflash_config.use_swa`
  slides every layer.
- The window: vLLM reads `dflash_config.swa_window_size`, then `sliding_window`; SGLang reads
  `sliding_window` (as window_left = sliding_window - 1). Both count the query's own position:
  a query at position q sees keys at positions j with q - W < j. A file whose two spellings
  differ would run as two models, so it is refused.
- Causality: sliding layers attend causally, full layers non-causally (both engines); vLLM's
  top-level `is_causal`, then `dflash_config.causal`, overrides every layer (SGLang ignores it).
"""

from __future__ import annotations

from typing import Any

from blockspec.config.common import positive_int, require

FULL, SLIDING = "full_attention", "sliding_attention"
DRAFT_LAYER_TYPES = (FULL, SLIDING)
# dflash_config keys read here (so they are not kept twice in `extra`).
DFLASH_ATTENTION_KEYS = ("swa_window_size", "use_swa", "causal")


def _window_value(name: str, value: Any, where: str) -> int | None:
    if value is None:
        return None
    require(isinstance(value, int) and not isinstance(value, bool),
             f"{where}: {name} must be a positive integer, got {value!r}")
    return positive_int(name, value, where)


def read_draft_attention(raw: dict[str, Any], dflash: dict[str, Any], num_layers: int, where: str
                         ) -> tuple[tuple[str, ...], int | None, bool | None]:
    """(layer types, window, causal override) of a draft config.json (module docstring)."""
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        require(isinstance(layer_types, list) and len(layer_types) == num_layers,
                 f"{where}: layer_types must list one entry per draft layer (num_hidden_layers is {num_layers}), "
                 f"got {len(layer_types) if isinstance(layer_types, list) else repr(layer_types)}")
        require(all(t in DRAFT_LAYER_TYPES for t in layer_types),
                 f"{where}: layer_types entries must be {' or '.join(DRAFT_LAYER_TYPES)}, got {layer_types!r}")
        types = tuple(layer_types)
    elif raw.get("use_sliding_window") and raw.get("sliding_window") is not None:
        first = raw.get("max_window_layers", 28)
        require(isinstance(first, int), f"{where}: max_window_layers must be an integer, got {first!r}")
        types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    else:
        types = (FULL,) * num_layers
    use_swa = dflash.get("use_swa", False)
    require(isinstance(use_swa, bool), f"{where}: dflash_config.use_swa must be true or false, got {use_swa!r}")
    if use_swa and SLIDING not in types:   # vLLM: use_swa slides every layer unless layer_types names some
        types = (SLIDING,) * num_layers
    nested = _window_value("dflash_config.swa_window_size", dflash.get("swa_window_size"), where)
    top = _window_value("sliding_window", raw.get("sliding_window"), where)
    window = None
    if SLIDING in types:
        require(nested is None or top is None or nested == top,
                 f"{where}: dflash_config.swa_window_size {nested} != sliding_window {top} (vLLM reads the "
                 "first, SGLang the second: the file would run as two different models)")
        window = nested if nested is not None else top
        require(window is not None, f"{where}: sliding_attention draft layers need a window "
                 "(sliding_window or dflash_config.swa_window_size)")
    causal = raw.get("is_causal", dflash.get("causal"))
    require(causal is None or isinstance(causal, bool),
             f"{where}: is_causal / dflash_config.causal must be true or false, got {causal!r}")
    return types, window, causal
