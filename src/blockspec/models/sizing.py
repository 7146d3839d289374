"""Size and sanity of a model config before any tensor is allocated.

A config is checked against the checkpoint's tensor headers (names, shapes: the field
that disagrees is named) and its size against the memory of the device it is loaded
on. Expected shapes come from the model classes themselves, built on the meta device
with ONE decoder layer (all layers are alike), so the cost does not grow with the
config's numbers and the check cannot drift from the modules.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch
from torch.overrides import TorchFunctionMode

from blockspec.config import DraftConfig, Eagle3Config, TargetConfig
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.eagle3 import Eagle3Draft
from blockspec.models.target import TargetModel
from blockspec.models.weights import TensorHeader

GIB = float(1 << 30)
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")

# The config fields behind each dimension of a weight, by the weight's last name parts
# (messages only: which field to check when a shape disagrees).
FIELDS = {
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "q_proj.weight": ("num_attention_heads x head_dim", "hidden_size"),
    "k_proj.weight": ("num_key_value_heads x head_dim", "hidden_size"),
    "v_proj.weight": ("num_key_value_heads x head_dim", "hidden_size"),
    "o_proj.weight": ("hidden_size", "num_attention_heads x head_dim"),
    "q_proj.bias": ("num_attention_heads x head_dim",),
    "k_proj.bias": ("num_key_value_heads x head_dim",),
    "v_proj.bias": ("num_key_value_heads x head_dim",),
    "q_norm.weight": ("head_dim",), "k_norm.weight": ("head_dim",),
    "gate_proj.weight": ("intermediate_size", "hidden_size"),
    "up_proj.weight": ("intermediate_size", "hidden_size"),
    "down_proj.weight": ("hidden_size", "intermediate_size"),
    "input_layernorm.weight": ("hidden_size",), "post_attention_layernorm.weight": ("hidden_size",),
    "norm.weight": ("hidden_size",), "hidden_norm.weight": ("hidden_size",),
    "fc.weight": ("hidden_size", "len(target_layer_ids) x hidden_size (EAGLE-3: 3 x target_hidden_size)"),
    "markov_w1.weight": ("vocab_size", "markov_rank"),
    "markov_w2.weight": ("vocab_size", "markov_rank"),
}


@dataclass(frozen=True)
class ModelSize:
    """Expected tensors of a config: shapes of the non-layer tensors and of layer 0."""

    outer: dict[str, tuple[int, ...]]
    layer: dict[str, tuple[int, ...]]   # names without the "layers.0." prefix
    num_layers: int

    @property
    def parameters(self) -> int:
        count = lambda shapes: sum(_numel(s) for s in shapes.values())  # noqa: E731
        return count(self.outer) + self.num_layers * count(self.layer)

    def bytes(self, dtype: torch.dtype) -> int:
        return self.parameters * dtype.itemsize

    def names(self) -> dict[str, tuple[int, ...]]:
        """Every expected tensor (O(layers): call after the layer count is checked)."""
        out = dict(self.outer)
        for i in range(self.num_layers):
            out.update({f"layers.{i}.{k}": s for k, s in self.layer.items()})
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split(shapes: dict[str, tuple[int, ...]], num_layers: int) -> ModelSize:
    outer = {k: s for k, s in shapes.items() if not k.startswith("layers.")}
    layer = {m.group(2): s for k, s in shapes.items() if (m := _LAYER.match(k)) and m.group(1) == "0"}
    return ModelSize(outer, layer, num_layers)


M = TypeVar("M", bound=torch.nn.Module)
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")
_INIT_LOCK = threading.Lock()


@contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's random initialisers as no-ops (as transformers' `no_init_weights`):
    on the meta device they do nothing useful, and the first one imports torch._dynamo
    through the meta kernels (seconds). Serialised: the patch is process-wide."""
    with _INIT_LOCK:
        saved = {name: getattr(torch.nn.init, name) for name in _INITS}
        try:
            for name in _INITS:
                setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)


class _StorageOnMeta(TorchFunctionMode):
    """Tensors made by the storage factories (torch.empty / zeros / ones / full / rand*:
    what parameters are made with) go to the meta device; everything else (RoPE
    frequencies from arange, small and cheap) runs as usual. Unlike the blanket
    torch.device("meta") context, no arithmetic runs on meta tensors, whose Python meta
    kernels import torch._dynamo on first use (seconds)."""

    FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
                           torch.empty_strided})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if func in self.FACTORIES:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def build_on_meta(make: Callable[[], M]) -> M:
    """`make()` with its parameters on the meta device: shapes only, no memory, no
    initialisation (non-persistent buffers such as RoPE frequencies are real)."""
    with _no_init(), _StorageOnMeta():
        return make()


def target_size(cfg: TargetConfig) -> ModelSize:
    """Tensors of a target (HF names without `model.`; lm_head absent when tied)."""
    # (a sliding window holds no tensors; its layer list would not fit one layer)
    one = build_on_meta(lambda: TargetModel(replace(cfg, num_hidden_layers=1, attention_window=None, window_layers=())))
    shapes = {k: tuple(v.shape) for k, v in one.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return _split(shapes, cfg.num_hidden_layers)


def draft_size(cfg: DraftConfig) -> ModelSize:
    one = build_on_meta(lambda: DraftModel(replace(cfg, num_hidden_layers=1, layer_types=(), sliding_window=None)))
    return _split({k: tuple(v.shape) for k, v in one.state_dict().items()}, cfg.num_hidden_layers)


def eagle3_size(cfg: Eagle3Config, own_embedding: bool) -> ModelSize:
    """Float tensors of an EAGLE-3 draft (one layer, `midlayer.*`; the d2t / t2d maps apart)."""
    one = build_on_meta(lambda: Eagle3Draft(cfg, own_embedding))
    return ModelSize({k: tuple(v.shape) for k, v in one.state_dict().items() if k not in ("d2t", "t2d")}, {}, 0)


def _field_message(name: str, expected: tuple[int, ...], found: tuple[int, ...]) -> str:
    key = ".".join(name.split(".")[-2:])
    fields = FIELDS.get(key)
    if fields is not None and len(expected) == len(found) == len(fields):
        wrong = [f"{f} (config: {e}, checkpoint: {g})" for f, e, g in zip(fields, expected, found) if e != g]
        return "; check " + ", ".join(wrong)
    return ""


def check_against_headers(size: ModelSize, headers: dict[str, TensorHeader], what: str) -> None:
    """The checkpoint holds exactly the tensors the config implies: layer count first (so a
    config asking for 10 million layers costs nothing), then every name and shape; the
    config field behind a wrong shape is named."""
    layers = sorted({int(m.group(1)) for k in headers if (m := _LAYER.match(k))})
    if layers != list(range(size.num_layers)):
        held = f"layers 0..{layers[-1]} ({len(layers)} layers)" if layers else "no layers"
        extra = "is missing tensors of layers" if len(layers) < size.num_layers else \
            "has tensors the config does not describe (layers)"
        raise BlockspecError(f"{what}: config num_hidden_layers = {size.num_layers} but the checkpoint holds {held}: "
                             f"the checkpoint {extra}")
    # Non-layer tensors and layer 0 first: O(1), and where a wrong field shows.
    for name, shape in [*size.outer.items(), *((f"layers.0.{k}", s) for k, s in size.layer.items())]:
        h = headers.get(name)
        if h is not None and h.shape != shape:
            raise BlockspecError(f"{what}: tensor '{name}' has shape {h.shape}, the config implies {shape}"
                                 + _field_message(name, shape, h.shape))
    expected = size.names()
    missing = [k for k in expected if k not in headers]
    unexpected = [k for k in headers if k not in expected]
    if missing:
        raise BlockspecError(f"{what}: checkpoint is missing tensors: {', '.join(missing[:6])}"
                             + (" ..." if len(missing) > 6 else ""))
    if unexpected:
        raise BlockspecError(f"{what}: checkpoint has tensors the config does not describe: "
                             f"{', '.join(unexpected[:6])}" + (" ..." if len(unexpected) > 6 else ""))
    for name, shape in expected.items():
        if headers[name].shape != shape:
            raise BlockspecError(f"{what}: tensor '{name}' has shape {headers[name].shape}, the config implies "
                                 f"{shape}" + _field_message(name, shape, headers[name].shape))


def available_bytes(device: torch.device) -> int | None:
    """Memory a load may use now: CUDA's free memory, or the host's MemAvailable
    (/proc/meminfo); None where it cannot be known (then no limit is applied)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def check_fits(size: ModelSize, dtype: torch.dtype, device: torch.device, what: str,
               available: int | None = None) -> None:
    """Refuse a model whose weights alone exceed the memory available on `device`."""
    need = size.bytes(dtype)
    free = available_bytes(device) if available is None else available
    if free is not None and need > free:
        raise BlockspecError(
            f"{what}: the config describes {size.parameters:,} parameters ({need / GIB:.2f} GiB in "
            f"{str(dtype).removeprefix('torch.')}) but only {free / GIB:.2f} GiB is available on {device} "
            f"(num_hidden_layers={size.num_layers})")
