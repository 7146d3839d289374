"""blockspec: lossless block speculative decoding (DFlash / DSpark).

Public API::

    from blockspec import load_target, load_draft, Tokenizer, SamplingParams, generate, Engine
"""

from blockspec.config import DraftConfig, SamplingParams, TargetConfig
from blockspec.decoding.engine import Engine
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_draft, load_target, save_draft, save_target
from blockspec.models.tokenizer import Tokenizer

__all__ = ["BlockspecError", "Engine", "DraftConfig", "SamplingParams", "TargetConfig", "Tokenizer", "generate",
           "load_draft", "load_target", "save_draft", "save_target"]
__version__ = "0.1.0"
