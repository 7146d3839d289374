"""blockspec: lossless block speculative decoding (DFlash / DSpark).

Public API::

    from blockspec import load_target, load_draft, Tokenizer, SamplingParams, generate, Engine
    from blockspec import GenerateOptions, PolicyOptions, EngineOptions   # keyword-only options
"""

from blockspec.config import DraftConfig, EagleTree, SamplingParams, TargetConfig
from blockspec.decoding.generate import GenerateOptions, generate
from blockspec.decoding.policy import PolicyOptions
from blockspec.engine.engine import Engine, EngineOptions
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_draft, load_target, save_draft, save_target
from blockspec.models.tokenizer import Tokenizer

__all__ = ["BlockspecError", "DraftConfig", "EagleTree", "Engine", "EngineOptions", "GenerateOptions", "PolicyOptions",
           "SamplingParams", "TargetConfig", "Tokenizer", "generate",
           "load_draft", "load_target", "save_draft", "save_target"]
__version__ = "0.1.0"
