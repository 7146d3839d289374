"""Configuration dataclasses, validated on construction.

`TargetConfig` reads a Hugging Face `config.json` (Qwen3 / Llama / Qwen2);
`DraftConfig` reads a z-lab DFlash or DeepSpec DSpark draft config, `Eagle3Config` an
EAGLE-3 (`LlamaForCausalLMEagle3`) one;
`SamplingParams` holds per-request decoding settings. Unknown keys of a config
file are kept in `extra` so that a load -> save round trip loses nothing.

Every config is a frozen value, validated when it is built: a changed setting
(a shorter draft block, say) is a new value made with `dataclasses.replace`.
"""

from blockspec.config.common import (DRAFT_METHODS, LIMITS, METHODS, RULES, SUPPORTED_ROPE_TYPES,
                                     SUPPORTED_TARGET_TYPES, read_json)
from blockspec.config.draft import DRAFT_HEAD_KEYS, LAYOUTS, MARKOV_TYPES, DraftConfig
from blockspec.config.draft_attention import DRAFT_LAYER_TYPES
from blockspec.config.eagle3 import (DEFAULT_CHAIN_DRAFTS, EAGLE3_ARCHITECTURES, ChainDraftConfig, Eagle3Config,
                                     EagleTree, default_aux_layer_ids)
from blockspec.config.rope import RopeConfig
from blockspec.config.sampling import (SAMPLING_EPS, TEMPERATURE_BANDS, GenerationDefaults, SamplingParams,
                                       temperature_band)
from blockspec.config.target import TargetConfig

__all__ = ["DEFAULT_CHAIN_DRAFTS", "DRAFT_HEAD_KEYS", "DRAFT_LAYER_TYPES", "DRAFT_METHODS", "EAGLE3_ARCHITECTURES", "LAYOUTS",
           "LIMITS", "MARKOV_TYPES", "METHODS", "RULES", "SAMPLING_EPS", "SUPPORTED_ROPE_TYPES", "SUPPORTED_TARGET_TYPES",
           "TEMPERATURE_BANDS", "ChainDraftConfig", "DraftConfig",
           "Eagle3Config", "EagleTree", "GenerationDefaults", "RopeConfig", "SamplingParams", "TargetConfig", "default_aux_layer_ids",
           "read_json", "temperature_band"]
