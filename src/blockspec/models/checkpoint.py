"""Safetensors + config.json I/O for Hugging Face target checkpoints.

Never pickle. Tensor names and shapes are checked against the config so a
wrong or truncated checkpoint fails loudly instead of generating garbage.
Draft checkpoints (z-lab / DeepSpec) share `read_tensors` / `write_tensors`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from blockspec.config import DraftConfig, TargetConfig, read_json
from blockspec.interop import EngineCompatibilityWarning, save_problems
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.layers import rope_inv_freq
from blockspec.models.target import TargetModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}


def parse_dtype(name: str | torch.dtype | None, default: str = "float32") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = (name or default).replace("torch.", "")
    if key not in DTYPES:
        raise BlockspecError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[key]


def read_tensors(directory: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or a sharded `model.safetensors.index.json`."""
    directory = Path(directory)
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index, f"{what} index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise BlockspecError(f"{what}: {index} has no 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        raise BlockspecError(f"{what}: no model.safetensors or model.safetensors.index.json in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise BlockspecError(f"{what}: shard {file} is missing")
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise BlockspecError(f"{what}: cannot read {file}: {exc}") from None
    return tensors


def write_tensors(directory: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata=metadata or {"format": "pt"})


def load_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str,
               dtype: torch.dtype, optional: tuple[str, ...] = ()) -> None:
    """Copy `tensors` into `module` after checking names and shapes exactly."""
    expected = dict(module.state_dict())
    # A tied lm_head shares the embedding: the checkpoint may omit it.
    missing = [k for k in expected if k not in tensors and k not in optional]
    unexpected = [k for k in tensors if k not in expected]
    if missing:
        raise BlockspecError(f"{what}: checkpoint is missing tensors: {', '.join(missing[:6])}"
                             + (" ..." if len(missing) > 6 else ""))
    if unexpected:
        raise BlockspecError(f"{what}: checkpoint has tensors the config does not describe: "
                             f"{', '.join(unexpected[:6])}" + (" ..." if len(unexpected) > 6 else ""))
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise BlockspecError(f"{what}: tensor '{name}' has shape {tuple(tensor.shape)}, "
                                 f"the config implies {tuple(expected[name].shape)}")
    module.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)


def resolve_device(name: str | None = "auto") -> torch.device:
    """"auto" (or None): the GPU when one is available, else the CPU; else as named."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(directory: str | Path, dtype: str | torch.dtype | None = "float32",
                device: str | torch.device = "cpu") -> TargetModel:
    directory = Path(directory)
    if not directory.is_dir():
        raise BlockspecError(f"target: {directory} is not a directory")
    cfg = TargetConfig.load(directory)
    torch_dtype = parse_dtype(dtype if dtype is not None else cfg.torch_dtype)
    with torch.device("meta"):
        model = TargetModel(cfg)
    model = model.to_empty(device=device).to(torch_dtype)
    # Non-persistent buffers are not in the checkpoint: recompute them.
    model.rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope).to(device)
    raw = read_tensors(directory, "target")
    tensors = {k.removeprefix("model."): v for k, v in raw.items()}
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    load_state(model, tensors, "target", torch_dtype, optional)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    return model


def target_tensors(model: TargetModel, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF names for a target's weights (lm_head omitted when tied)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        hf = name if name == "lm_head.weight" else f"model.{name}"
        out[hf] = tensor.detach().to(dtype or tensor.dtype).cpu()
    return out


def save_checkpoint(directory: str | Path, config: dict, tensors: dict[str, torch.Tensor],
                    dtype: torch.dtype) -> None:
    """config.json (with torch_dtype) + model.safetensors, the layout every loader reads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": str(dtype).replace("torch.", "")}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tensors(directory, tensors)


def save_target(model: TargetModel, directory: str | Path, dtype: str | torch.dtype | None = None) -> None:
    torch_dtype = parse_dtype(dtype) if dtype is not None else model.dtype
    save_checkpoint(directory, model.config.to_dict(), target_tensors(model, torch_dtype), torch_dtype)


# -- drafts (docs/design.md section 6) ------------------------------------------------------
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


def load_draft(directory: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               target: TargetModel | None = None) -> DraftModel:
    """Load a z-lab DFlash or DeepSpec DSpark draft; check it against `target` if given."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BlockspecError(f"draft: {directory} is not a directory")
    cfg = DraftConfig.load(directory)
    if target is not None:
        cfg.check_target(target.config)
    torch_dtype = parse_dtype(dtype)
    model = DraftModel(cfg).to(device=device, dtype=torch_dtype)
    model.rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope).to(device)
    tensors = {k.removeprefix("model."): v for k, v in read_tensors(directory, "draft").items()}
    for name in SHARED_WITH_TARGET:  # some exports carry the shared tensors; they are the target's
        tensors.pop(name, None)
    load_state(model, tensors, "draft", torch_dtype)
    model.eval().requires_grad_(False)
    return model


def save_draft(model: DraftModel, directory: str | Path, dtype: str | torch.dtype | None = None,
               mask_token: str | None = None) -> None:
    """Write the draft in its layout's format (z-lab DFlash / DeepSpec DSpark) with every key
    vLLM and SGLang read; `mask_token` (the mask id's string in the target tokenizer) is
    written when the config has none. Warns (EngineCompatibilityWarning) for each thing an
    engine's loader cannot load: interop_engines.json, docs/serving.md."""
    torch_dtype = parse_dtype(dtype) if dtype is not None else model.dtype
    tensors = {k: v.detach().to(torch_dtype).cpu() for k, v in model.state_dict().items()}
    cfg = model.config
    if mask_token is not None and cfg.mask_token is None:
        cfg = replace(cfg, mask_token=mask_token)
    config = cfg.to_dict()
    save_checkpoint(directory, config, tensors, torch_dtype)
    for problem in save_problems(config, {k: tuple(v.shape) for k, v in tensors.items()}):
        warnings.warn(f"saved draft {directory}: {problem}", EngineCompatibilityWarning, stacklevel=2)
