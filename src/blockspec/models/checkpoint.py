"""Safetensors + config.json I/O for Hugging Face target checkpoints.

Never pickle. Loading checks before it allocates: the config's sanity limits, the
checkpoint's tensor headers (names, shapes, float dtypes; `models.sizing` names the
config field that disagrees) and the weights' size against the device's free memory.
The model is then built on the meta device, allocated uninitialised on its device in
its dtype, and filled tensor by tensor from the files (`models.weights.TensorReader`:
no random init, no float32 detour, no whole-shard copy), each tensor checked for NaN /
Inf unless `allow_nonfinite`. Draft checkpoints (z-lab / DeepSpec, EAGLE-3) load the same way.

dtype arguments: a name ("float32", "bfloat16", ...), "auto" (the checkpoint's dtype:
config `torch_dtype` / `dtype`, else the dtype of most of its weight bytes, as
transformers' dtype="auto"), or None (= "auto" on a GPU, float32 elsewhere: CPU
bfloat16 / float16 matmuls are several times slower than float32).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from blockspec.config import DraftConfig, Eagle3Config, GenerationDefaults, TargetConfig, read_json
from blockspec.interop import EngineCompatibilityWarning, save_problems
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.eagle3 import Eagle3Draft
from blockspec.models.layers import RotaryEmbedding
from blockspec.models.sizing import (build_on_meta, check_against_headers, check_fits, draft_size, eagle3_size,
                                    target_size)
from blockspec.models.target import TargetModel
from blockspec.models.weights import TensorHeader, TensorReader, check_float, read_headers, read_tensor
from blockspec.models.weights import read_tensors  # noqa: F401  (re-exported: training resume states)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}


def parse_dtype(name: str | torch.dtype | None, default: str = "float32") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = (name or default).replace("torch.", "")
    if key not in DTYPES:
        raise BlockspecError(f"unknown dtype {name!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[key]


def resolve_dtype(name: str | torch.dtype | None, device: torch.device,
                  stored: Callable[[], torch.dtype]) -> torch.dtype:
    """The dtype to load in (module docstring): None = "auto" on a GPU, else float32;
    "auto" = `stored()`, the checkpoint's dtype."""
    if name is None:
        name = "auto" if device.type == "cuda" else "float32"
    return stored() if name == "auto" else parse_dtype(name)


def stored_dtype(directory: Path, headers: dict[str, TensorHeader]) -> torch.dtype:
    """The checkpoint's own dtype: config.json's torch_dtype / dtype when it names a float
    type, else the float dtype holding most of the weights' bytes."""
    raw = read_json(Path(directory) / "config.json", "config")
    named = str(raw.get("torch_dtype") or raw.get("dtype") or "").removeprefix("torch.")
    if named in DTYPES:
        return DTYPES[named]
    by_bytes: dict[torch.dtype, int] = {}
    for h in headers.values():
        if h.torch_dtype is not None:
            by_bytes[h.torch_dtype] = by_bytes.get(h.torch_dtype, 0) + h.nbytes
    return max(by_bytes, key=by_bytes.__getitem__) if by_bytes else torch.float32


def model_headers(directory: Path, what: str, drop: Callable[[str], bool] = lambda name: False
                  ) -> dict[str, TensorHeader]:
    """The checkpoint's tensor headers under the model's names (HF's `model.` prefix
    removed), minus those `drop` names; every kept tensor must be a float type."""
    out: dict[str, TensorHeader] = {}
    for name, header in read_headers(Path(directory), what).items():
        key = name.removeprefix("model.")
        if drop(key):
            continue
        if key in out:
            raise BlockspecError(f"{what}: tensor '{key}' appears twice (with and without the 'model.' prefix)")
        check_float(header, what)
        out[key] = header
    return out


def write_tensors(directory: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata=metadata or {"format": "pt"})


def fill_weights(module: torch.nn.Module, headers: dict[str, TensorHeader], what: str,
                 allow_nonfinite: bool = False, skip: tuple[str, ...] = ()) -> None:
    """Read every state tensor of `module` (already checked against `headers`) from the
    files, in file order, chunk by chunk (models.weights.TensorReader)."""
    state = {k: v for k, v in module.state_dict().items() if k not in skip}
    order = sorted(state, key=lambda k: (str(headers[k].file), headers[k].offset))
    with torch.no_grad(), TensorReader(what, allow_nonfinite) as reader:
        for name in order:
            reader.load(headers[name], state[name], display=name)


def build_empty(make: Callable[[], torch.nn.Module], dtype: torch.dtype, device: torch.device,
                untie: Callable[[torch.nn.Module], tuple[torch.nn.Module, ...]] = lambda model: ()
                ) -> torch.nn.Module:
    """`make()` built on the meta device (no memory, no random init), then given
    uninitialised storage on `device` in `dtype`. `untie(model)`: modules whose `weight`
    is shared with another module; they get no storage of their own (re-tie after)."""
    model = build_on_meta(make)
    for m in untie(model):
        m.register_parameter("weight", None)
    # Module.to_empty would go through torch's Python meta kernels (importing sympy on
    # first use); plain torch.empty per tensor, shared tensors allocated once.
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        return made[id(t)]

    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(empty(p), requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = empty(b) if b.is_meta else b.to(device)
    return model


def _rotary(model: torch.nn.Module, head_dim: int, rope, device: torch.device) -> None:
    """Non-persistent buffers (RoPE frequencies) are not in the checkpoint: build the
    rotary module for real on the device."""
    model.rotary = RotaryEmbedding(head_dim, rope).to(device)


def _merge_generation_eos(cfg: TargetConfig, directory: Path) -> TargetConfig:
    """generation_config.json's eos ids join the config's (vLLM: Qwen's <|im_end|> and
    <|endoftext|> both stop); every stop id must be a token of the vocabulary."""
    gen = GenerationDefaults.load(directory)
    ids = list(cfg.eos_token_id) + [t for t in gen.eos_token_id if t not in cfg.eos_token_id]
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < cfg.vocab_size]
    if bad:
        raise BlockspecError(f"target: eos_token_id {bad} (config.json / generation_config.json) is outside "
                             f"the {cfg.vocab_size}-token vocabulary")
    return cfg if ids == list(cfg.eos_token_id) else replace(cfg, eos_token_id=ids)


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None): the GPU when one is available, else the CPU; else as named."""
    if isinstance(name, torch.device):
        return name
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise BlockspecError(f"unknown device {name!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BlockspecError(f"device {name!r} was asked for but CUDA is not available (use --device cpu)")
    return device


def _inv_freq_entry(name: str) -> bool:
    """Old Llama checkpoints store RoPE frequencies; blockspec recomputes them."""
    return name.endswith("rotary_emb.inv_freq")


def load_target(directory: str | Path, dtype: str | torch.dtype | None = None,
                device: str | torch.device | None = "cpu", *, allow_nonfinite: bool = False) -> TargetModel:
    """A Hugging Face target checkpoint on `device` in `dtype` (module docstring), checked
    before anything is allocated; generation_config.json's eos ids join the config's."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BlockspecError(f"target: {directory} is not a directory")
    dev = resolve_device(device)
    cfg = _merge_generation_eos(TargetConfig.load(directory), directory)
    tied = cfg.tie_word_embeddings
    headers = model_headers(directory, "target",
                            lambda k: _inv_freq_entry(k) or (tied and k == "lm_head.weight"))
    size = target_size(cfg)
    check_against_headers(size, headers, "target")
    torch_dtype = resolve_dtype(dtype, dev, lambda: stored_dtype(directory, headers))
    check_fits(size, torch_dtype, dev, "target")
    model = build_empty(lambda: TargetModel(cfg), torch_dtype, dev,
                        untie=lambda m: (m.lm_head,) if tied else ())
    _rotary(model, cfg.head_dim, cfg.rope, dev)
    fill_weights(model, headers, "target", allow_nonfinite, skip=("lm_head.weight",) if tied else ())
    if tied:
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


def _draft_config(directory: str | Path, device: str | torch.device | None, target: TargetModel | None,
                  config_type: type[DraftConfig] | type[Eagle3Config], what: str
                  ) -> tuple[Path, torch.device, DraftConfig | Eagle3Config]:
    """(directory, device, config) of a draft directory, the config checked against `target`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BlockspecError(f"{what}: {directory} is not a directory")
    cfg = config_type.load(directory)
    if target is not None:
        cfg.check_target(target.config)
    return directory, resolve_device(device), cfg


def load_draft(directory: str | Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = "cpu", target: TargetModel | None = None, *,
               allow_nonfinite: bool = False) -> DraftModel:
    """Load a z-lab DFlash or DeepSpec DSpark draft; check it against `target` if given.
    dtype None: the target's when a target is given, else as in the module docstring."""
    directory, dev, cfg = _draft_config(directory, device, target, DraftConfig, "draft")
    # Some exports carry the shared tensors; they are the target's.
    headers = model_headers(directory, "draft", lambda k: k in SHARED_WITH_TARGET or _inv_freq_entry(k))
    size = draft_size(cfg)
    check_against_headers(size, headers, "draft")
    if dtype is None and target is not None:
        dtype = target.dtype
    torch_dtype = resolve_dtype(dtype, dev, lambda: stored_dtype(directory, headers))
    check_fits(size, torch_dtype, dev, "draft")
    model = build_empty(lambda: DraftModel(cfg), torch_dtype, dev)
    _rotary(model, cfg.head_dim, cfg.rope, dev)
    fill_weights(model, headers, "draft", allow_nonfinite)
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


# -- EAGLE-3 drafts (docs/design.md section 6) -------------------------------------------------
EAGLE3_MAPS = ("d2t", "t2d")


def _eagle3_name(name: str) -> str:
    """A file's tensor name as the model's: HF's `model.` prefix dropped, and vLLM's
    `layers.0.` spelling of the one layer read as `midlayer.` (SGLang reads only the latter)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def _vocabulary_maps(headers: dict[str, TensorHeader], cfg: Eagle3Config) -> torch.Tensor:
    """The target id of every draft token, from d2t (offsets: target = draft + d2t[draft], as
    vLLM and SGLang read it), checked against t2d when the file has one. No d2t: the identity,
    allowed only for a full-vocabulary draft."""
    what, vd, v = "EAGLE-3 draft", cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in headers:
        if vd != v:
            raise BlockspecError(f"{what}: no d2t tensor, but draft_vocab_size {vd} < vocab_size {v} needs one")
        return torch.arange(v)
    d2t = read_tensor(headers["d2t"], what)
    if d2t.shape != (vd,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise BlockspecError(f"{what}: d2t must be an integer tensor of shape ({vd},) (draft_vocab_size), got "
                             f"{str(d2t.dtype).removeprefix('torch.')} {tuple(d2t.shape)}")
    ids = torch.arange(vd) + d2t.long()
    if bool(((ids < 0) | (ids >= v)).any()) or torch.unique(ids).numel() != vd:
        raise BlockspecError(f"{what}: d2t maps draft tokens outside the {v}-token vocabulary or two onto one token")
    if "t2d" in headers:
        t2d = read_tensor(headers["t2d"], what)
        if t2d.shape != (v,) or t2d.is_floating_point():
            raise BlockspecError(f"{what}: t2d must be a bool (or 0/1 integer) tensor of shape ({v},) (vocab_size)")
        if not torch.equal(t2d.bool(), torch.isin(torch.arange(v), ids)):
            raise BlockspecError(f"{what}: t2d does not mark exactly the target tokens d2t maps to")
    return ids


def load_eagle3(directory: str | Path, dtype: str | torch.dtype | None = None,
                device: str | torch.device | None = "cpu", target: TargetModel | None = None, *,
                allow_nonfinite: bool = False) -> Eagle3Draft:
    """An EAGLE-3 draft in the LlamaForCausalLMEagle3 layout; checked against `target` if given.
    An `embed_tokens` tensor in the file becomes the draft's own embedding; without one the
    draft borrows the target's (its hidden size must then be the target's)."""
    what = "EAGLE-3 draft"
    directory, dev, cfg = _draft_config(directory, device, target, Eagle3Config, what)
    headers: dict[str, TensorHeader] = {}
    for name, header in read_headers(directory, what).items():
        key = _eagle3_name(name)
        if key in headers:
            raise BlockspecError(f"{what}: tensor '{key}' appears twice (under two spellings)")
        if key.startswith(("layers.", "additional_layers.")):
            raise BlockspecError(f"{what}: tensor '{name}' belongs to a second decoder layer; only one-layer "
                                 "EAGLE-3 drafts are supported")
        if key not in EAGLE3_MAPS and not _inv_freq_entry(key):
            check_float(header, what, key)
        headers[key] = header
    own = "embed_tokens.weight" in headers
    if not own and target is not None and cfg.hidden_size != target.config.hidden_size:
        raise BlockspecError(f"{what}: no embed_tokens in the checkpoint and hidden_size {cfg.hidden_size} differs "
                             f"from the target's {target.config.hidden_size}: the target's embedding cannot be used")
    size = eagle3_size(cfg, own)
    check_against_headers(size, {k: h for k, h in headers.items() if k not in EAGLE3_MAPS and not _inv_freq_entry(k)},
                          what)
    vocabulary = _vocabulary_maps(headers, cfg)
    if dtype is None and target is not None:
        dtype = target.dtype
    torch_dtype = resolve_dtype(dtype, dev, lambda: stored_dtype(directory, headers))
    check_fits(size, torch_dtype, dev, what)
    model = build_empty(lambda: Eagle3Draft(cfg, own), torch_dtype, dev)
    _rotary(model, cfg.head_dim, cfg.rope, dev)
    fill_weights(model, headers, what, allow_nonfinite, skip=EAGLE3_MAPS)
    model.set_vocabulary(vocabulary)
    model.eval().requires_grad_(False)
    return model


def save_eagle3(model: Eagle3Draft, directory: str | Path, dtype: str | torch.dtype | None = None) -> None:
    """The draft in the LlamaForCausalLMEagle3 layout: config.json (both spellings of the
    auxiliary layers) and model.safetensors with `midlayer.*`, `fc`, `norm`, `lm_head`, d2t
    (int64 offsets) and t2d (bool), as SpecForge writes them; `embed_tokens` only when the
    draft has its own. Warns (EngineCompatibilityWarning) where an engine would read it
    differently."""
    torch_dtype = parse_dtype(dtype) if dtype is not None else model.dtype
    tensors = {k: (v if k in EAGLE3_MAPS else v.to(torch_dtype)).detach().cpu() for k, v in model.state_dict().items()}
    save_checkpoint(directory, model.config.to_dict(), tensors, torch_dtype)
    if model.config.norm_before_residual:
        warnings.warn(f"saved EAGLE-3 draft {directory}: norm_before_residual is true, which SGLang does not read "
                      "(it takes the residual before hidden_norm): the draft runs wrongly there",
                      EngineCompatibilityWarning, stacklevel=2)
