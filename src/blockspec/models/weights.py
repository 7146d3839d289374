"""Safetensors checkpoints read as a hostile file would be: headers first, tensor by tensor.

Nothing here trusts the checkpoint. Shard paths of `model.safetensors.index.json` must
stay inside the checkpoint directory; headers are parsed (names, dtypes, shapes, byte
ranges, see the safetensors format: 8-byte little-endian header length + JSON) and checked
before one byte of tensor data is read; tensor data is then read straight from the file
into the model's parameters, one bounded chunk at a time (no mmap, no whole-shard copy,
no float32 detour), and every chunk is checked for NaN / Inf unless the caller opts out.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.config import read_json
from blockspec.config.common import resolve_inside
from blockspec.errors import BlockspecError

# safetensors dtype names: floating types a model can hold, and every other type's byte size.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
CHUNK_BYTES = 64 << 20          # host staging per read: bounds the extra memory of a load


@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors file, as its header describes it (no data read)."""

    name: str
    dtype: str                  # safetensors name: "BF16", "F32", "I8", ...
    shape: tuple[int, ...]
    file: Path
    offset: int                 # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return FLOAT_DTYPES.get(self.dtype)


def safe_member(directory: Path, name: object, what: str) -> Path:
    """`directory / name` if it stays inside the checkpoint (no absolute path, no `..`,
    no symlink out of it); else BlockspecError naming the entry."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise BlockspecError(f"{what}: shard name {name!r} is not a file name")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise BlockspecError(f"{what}: shard path {name!r} leaves the checkpoint directory; refusing to read it")
    path = directory / name
    resolve_inside(directory, path, f"{what}: shard")
    return path


def checkpoint_files(directory: Path, what: str) -> list[Path]:
    """The safetensors files of a checkpoint: `model.safetensors`, or the shards of
    `model.safetensors.index.json` (each checked by `safe_member`)."""
    directory = Path(directory)
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [safe_member(directory, single.name, what)]
    if not index.is_file():
        raise BlockspecError(f"{what}: no model.safetensors or model.safetensors.index.json in {directory}")
    weight_map = read_json(index, f"{what} index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise BlockspecError(f"{what}: {index} has no 'weight_map'")
    files = [safe_member(directory, name, what) for name in sorted(set(weight_map.values()), key=str)]
    for file in files:
        if not file.is_file():
            raise BlockspecError(f"{what}: shard {file} is missing")
    return files


def read_header(file: Path, what: str) -> dict[str, TensorHeader]:
    """The tensors of one safetensors file, checked: known dtypes, sizes that match the
    shapes, byte ranges inside the file and not overlapping. Reads the header only."""
    def bad(reason: str) -> BlockspecError:
        return BlockspecError(f"{what}: cannot read {file}: {reason}")

    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise bad("too short for a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise bad(f"header length {length} is larger than the file or the format's limit")
            raw = json.loads(fh.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(str(exc)) from None
    if not isinstance(raw, dict):
        raise bad("the header is not a JSON object")
    start, data_size = 8 + length, size - 8 - length
    out: dict[str, TensorHeader] = {}
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise bad(f"tensor '{name}' has no header entry")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise bad(f"tensor '{name}' has unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise bad(f"tensor '{name}' has a malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_size):
            raise bad(f"tensor '{name}' has data offsets {offsets!r} outside the file")
        header = TensorHeader(name, dtype, tuple(shape), file, start + offsets[0], offsets[1] - offsets[0])
        if header.nbytes != header.numel * ITEMSIZE[dtype]:
            raise bad(f"tensor '{name}' holds {header.nbytes} bytes, its shape {tuple(shape)} needs "
                      f"{header.numel * ITEMSIZE[dtype]}")
        out[name] = header
    spans = sorted((h.offset, h.offset + h.nbytes, h.name) for h in out.values() if h.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"tensors '{a}' and '{b}' overlap")
    return out


def read_headers(directory: Path, what: str) -> dict[str, TensorHeader]:
    """Every tensor header of a (possibly sharded) checkpoint; a name in two shards is refused."""
    headers: dict[str, TensorHeader] = {}
    for file in checkpoint_files(directory, what):
        for name, header in read_header(file, what).items():
            if name in headers:
                raise BlockspecError(f"{what}: tensor '{name}' appears in both {headers[name].file.name} "
                                     f"and {file.name}")
            headers[name] = header
    return headers


def check_float(header: TensorHeader, what: str, display: str | None = None) -> None:
    """A weight must be stored as a floating type blockspec computes with."""
    if header.torch_dtype is None:
        raise BlockspecError(
            f"{what}: tensor '{display or header.name}' is stored as {header.dtype}; blockspec needs floating-point "
            f"weights ({', '.join(FLOAT_DTYPES)}); quantised checkpoints are not supported")


def _check_finite(chunk: torch.Tensor, name: str, what: str) -> None:
    """NaN / Inf in a weight (or a value that overflowed the dtype it was cast to). A sum
    is finite only if every term is (NaN and Inf propagate), and costs one pass with no
    temporaries; only a non-finite sum (or an overflowing one) is checked element-wise."""
    if torch.isfinite(chunk.sum(dtype=torch.float64 if chunk.dtype == torch.float64 else torch.float32)):
        return
    if not bool(torch.isfinite(chunk).all()):
        raise BlockspecError(
            f"{what}: tensor '{name}' holds non-finite values (NaN or Inf, as "
            f"{str(chunk.dtype).removeprefix('torch.')}); the checkpoint is corrupt "
            "(allow_nonfinite=True / --allow-nonfinite-weights loads it anyway)")


class TensorReader:
    """Reads tensors of checkpoint files into existing tensors (any device and float
    dtype), chunk by chunk: straight into the destination's memory when it is a CPU tensor
    of the file's dtype, else through one reused staging buffer of CHUNK_BYTES."""

    def __init__(self, what: str, allow_nonfinite: bool = False) -> None:
        if sys.byteorder != "little":
            raise BlockspecError("safetensors data is little-endian; this host is big-endian")
        self.what, self.allow_nonfinite = what, allow_nonfinite
        self._files: dict[Path, object] = {}
        self._staging: torch.Tensor | None = None

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: object) -> None:
        for fh in self._files.values():
            fh.close()  # type: ignore[attr-defined]
        self._files.clear()
        self._staging = None

    def _read(self, header: TensorHeader, offset: int, out: memoryview) -> None:
        fh = self._files.get(header.file)
        if fh is None:
            fh = self._files[header.file] = open(header.file, "rb", buffering=0)
        fh.seek(offset)  # type: ignore[attr-defined]
        done = 0
        while done < len(out):
            n = fh.readinto(out[done:])  # type: ignore[attr-defined]
            if not n:
                raise BlockspecError(f"{self.what}: {header.file} ends inside tensor '{header.name}'")
            done += n

    def load(self, header: TensorHeader, dest: torch.Tensor, display: str | None = None) -> None:
        """Fill `dest` (contiguous, the header's shape) with the tensor's values, cast to
        dest's dtype, checking each chunk for NaN / Inf (after the cast, so values that
        overflow the target dtype are caught too)."""
        check_float(header, self.what, display)
        name = display or header.name
        src_dtype = header.torch_dtype
        assert src_dtype is not None and dest.is_contiguous() and dest.numel() == header.numel
        flat = dest.view(-1)
        item = ITEMSIZE[header.dtype]
        step = max(1, CHUNK_BYTES // item)
        direct = dest.device.type == "cpu" and dest.dtype == src_dtype
        for start in range(0, header.numel, step):
            n = min(step, header.numel - start)
            part = flat[start:start + n]
            if direct:  # the file's bytes land in the parameter itself
                self._read(header, header.offset + start * item, memoryview(part.view(torch.uint8).numpy()))
            else:
                if self._staging is None:
                    self._staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
                raw = self._staging[:n * item]
                self._read(header, header.offset + start * item, memoryview(raw.numpy()))
                part.copy_(raw.view(src_dtype))
            if not self.allow_nonfinite:
                _check_finite(part, name, self.what)


_ANY_DTYPES = {**FLOAT_DTYPES, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
               "U8": torch.uint8, "BOOL": torch.bool}


def read_tensor(header: TensorHeader, what: str) -> torch.Tensor:
    """One tensor as a CPU tensor of the file's dtype (small tensors: integer maps, resume
    states), read whole; its header was checked by `read_header`."""
    dtype = _ANY_DTYPES.get(header.dtype)
    if dtype is None:
        raise BlockspecError(f"{what}: tensor '{header.name}' has dtype {header.dtype}, which blockspec does not read")
    buf = torch.empty(header.nbytes, dtype=torch.uint8)
    with open(header.file, "rb") as fh:
        fh.seek(header.offset)
        if fh.readinto(memoryview(buf.numpy())) != header.nbytes:
            raise BlockspecError(f"{what}: {header.file} ends inside tensor '{header.name}'")
    return buf.view(dtype).view(header.shape)


def read_tensors(directory: Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as CPU tensors of the file's dtypes (training resume
    states: small files, integer tensors allowed), with shard paths and headers checked
    as for a model."""
    return {name: read_tensor(h, what) for name, h in read_headers(Path(directory), what).items()}
