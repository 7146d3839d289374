"""Hostile and absurd checkpoints (issue 22): refused before anything is allocated, naming
the field or the tensor; corrupt weights refused on load; shard paths kept inside."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockspec.models.checkpoint as checkpoint
import blockspec.models.sizing as sizing
from blockspec import embedded
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_draft, load_target, save_draft, save_target
from blockspec.models.weights import read_headers
from conftest import make_draft, make_target


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def target_dir(tmp_path, target):
    save_target(target, tmp_path / "t")
    return tmp_path / "t"


@pytest.fixture
def draft_dir(tmp_path, target):
    save_draft(make_draft(target, "deepspec", 4, markov_rank=8, confidence=True), tmp_path / "d")
    return tmp_path / "d"


def edit_config(path: Path, **changes) -> None:
    """Rewrite config.json with `changes`; a new layer count keeps the file consistent (its
    per-layer layer_types follow), so what is tested is the size, not a mismatched list."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    if "num_hidden_layers" in changes and isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = [cfg["layer_types"][0]] * min(changes["num_hidden_layers"], 1024)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if a model is ever materialised."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was allocated")
    monkeypatch.setattr(checkpoint, "build_empty", refuse)


# -- absurd configs: refused in under a second, naming the field, allocating nothing -------------

@pytest.mark.parametrize("changes, field", [
    ({"vocab_size": 10**9}, "vocab_size"),
    ({"num_hidden_layers": 10**7}, "num_hidden_layers"),
    ({"hidden_size": 10**6}, "hidden_size"),
    ({"intermediate_size": 10**6}, "intermediate_size"),          # under the limit: the headers disagree
    ({"num_hidden_layers": 64}, "num_hidden_layers"),
    ({"vocab_size": 1000}, "vocab_size"),
    ({"num_attention_heads": 8, "head_dim": 8}, "num_attention_heads x head_dim"),
    ({"max_position_embeddings": 10**9}, "max_position_embeddings"),
])
def test_absurd_target_configs_refused_fast_without_allocating(target_dir, no_allocation, changes, field):
    edit_config(target_dir, **changes)
    before, t0 = rss_bytes(), time.perf_counter()
    with pytest.raises(BlockspecError, match=field.replace("(", r"\(")):
        load_target(target_dir)
    assert time.perf_counter() - t0 < 1.0
    assert rss_bytes() - before < 64 << 20


@pytest.mark.parametrize("changes, field", [
    ({"intermediate_size": 10**6, "num_hidden_layers": 64}, "num_hidden_layers"),
    ({"intermediate_size": 10**6}, "intermediate_size"),
    ({"markov_rank": 10**6}, "markov_rank"),
    ({"num_hidden_layers": 10**7}, "num_hidden_layers"),
    ({"block_size": 10**6}, "block_size"),
])
def test_absurd_draft_configs_refused_fast_without_allocating(draft_dir, target, no_allocation, changes, field):
    edit_config(draft_dir, **changes)
    before, t0 = rss_bytes(), time.perf_counter()
    with pytest.raises(BlockspecError, match=field):
        load_draft(draft_dir, target=target)
    assert time.perf_counter() - t0 < 1.0
    assert rss_bytes() - before < 64 << 20


def test_a_model_bigger_than_memory_is_refused_before_allocating(target_dir, monkeypatch, no_allocation):
    monkeypatch.setattr(sizing, "available_bytes", lambda device: 1000)
    with pytest.raises(BlockspecError, match=r"parameters .* GiB in float32\) but only 0.00 GiB is available on cpu"):
        load_target(target_dir)


def test_size_from_the_config_matches_the_built_model(target):
    size = sizing.target_size(target.config)
    params = {id(p): p.numel() for p in target.parameters()}  # tied weights counted once
    assert size.parameters == sum(params.values())
    assert size.bytes(torch.bfloat16) == 2 * size.parameters
    draft = make_draft(target, "deepspec", 4, markov_rank=8, markov_type="rnn", confidence=True, layers=2)
    assert sizing.draft_size(draft.config).parameters == sum(p.numel() for p in draft.parameters())


def test_memory_available_is_read():
    free = sizing.available_bytes(torch.device("cpu"))
    assert free is None or free > 0


def test_cli_exits_2_with_one_line_and_small_memory(tmp_path):
    """The CLI on a draft config asking for 64 x 1e6-wide layers (11 GB before)."""
    draft_dir = tmp_path / "d"
    shutil.copytree(embedded.default_draft("dspark"), draft_dir)
    edit_config(draft_dir, intermediate_size=10**6, num_hidden_layers=64)
    # VmHWM: the peak of this program's own memory (ru_maxrss would also count the pytest
    # process's pages the child shared between fork and exec).
    code = ("import sys; from blockspec.cli import main; rc = main(sys.argv[1:]); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr); "
            "sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    out = subprocess.run([sys.executable, "-c", code, "generate", "hi", "--method", "dspark", "--draft",
                          str(draft_dir), "--device", "cpu"], capture_output=True, text=True, env=env, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 2 and lines[0].startswith("error: draft") and "num_hidden_layers" in lines[0]
    assert int(lines[1]) * 1024 < 1.5 * (1 << 30)  # peak RSS: the interpreter and torch, no weights


# -- corrupt weights ---------------------------------------------------------------------------

def rewrite(path: Path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_refused_naming_the_tensor(target_dir, value):
    def poison(t):
        t["model.layers.2.mlp.up_proj.weight"][3, 5] = value
    rewrite(target_dir, poison)
    with pytest.raises(BlockspecError, match=r"tensor 'layers.2.mlp.up_proj.weight' holds non-finite"):
        load_target(target_dir)
    model = load_target(target_dir, allow_nonfinite=True)  # the opt-out
    got = model.layers[2].mlp.up_proj.weight[3, 5].item()
    assert got != got if value != value else got == value


def test_values_overflowing_the_asked_dtype_are_refused(target_dir):
    rewrite(target_dir, lambda t: t["model.norm.weight"].fill_(1e6))
    load_target(target_dir, dtype="float32")
    with pytest.raises(BlockspecError, match=r"'norm.weight' holds non-finite values \(NaN or Inf, as float16\)"):
        load_target(target_dir, dtype="float16")


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn])
def test_integer_and_quantised_weights_refused_naming_the_tensor(target_dir, dtype, no_allocation):
    def quantise(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].to(dtype)
    rewrite(target_dir, quantise)
    with pytest.raises(BlockspecError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' is stored as "
                                             r"(I8|U8|I32|F8_E4M3); blockspec needs floating-point"):
        load_target(target_dir)


def test_draft_nan_refused(draft_dir, target):
    rewrite(draft_dir, lambda t: t["fc.weight"].view(-1)[-1:].fill_(float("nan")))
    with pytest.raises(BlockspecError, match="draft: tensor 'fc.weight' holds non-finite"):
        load_draft(draft_dir, target=target)


# -- shard paths --------------------------------------------------------------------------------

def shard(path: Path, files: dict[str, str]) -> None:
    """Replace model.safetensors by an index whose weight_map sends each tensor to files[name]."""
    names = list(read_headers(path, "t"))
    (path / "model.safetensors").rename(path / "part.safetensors")
    weight_map = {n: files.get(n, "part.safetensors") for n in names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("name, message", [
    ("../../../../../../etc/passwd", "leaves the checkpoint directory"),
    ("/etc/passwd", "leaves the checkpoint directory"),
    ("sub/../../x.safetensors", "leaves the checkpoint directory"),
    ("", "is not a file name"),
])
def test_shard_paths_outside_the_directory_are_refused(target_dir, monkeypatch, name, message):
    shard(target_dir, {"model.norm.weight": name})
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    with pytest.raises(BlockspecError, match=message):
        load_target(target_dir)
    assert not any("passwd" in f for f in opened)


def test_symlinked_shard_escaping_is_refused(tmp_path, target_dir):
    shard(target_dir, {})
    outside = tmp_path / "elsewhere.safetensors"
    (target_dir / "part.safetensors").rename(outside)
    (target_dir / "part.safetensors").symlink_to(outside)
    with pytest.raises(BlockspecError, match="outside the checkpoint directory"):
        load_target(target_dir)


def test_hub_cache_snapshot_symlinks_load(tmp_path, target, target_dir):
    """A Hugging Face cache snapshot: files are symlinks to ../../blobs (allowed)."""
    repo = tmp_path / "models--x--y"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in target_dir.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    loaded = load_target(snap)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), target.state_dict().values()))


def test_sharded_checkpoint_loads_equal(target_dir, target):
    tensors = load_file(str(target_dir / "model.safetensors"))
    names = sorted(tensors)
    half = {n: tensors[n] for n in names[: len(names) // 2]}
    rest = {n: tensors[n] for n in names[len(names) // 2:]}
    save_file(half, str(target_dir / "a.safetensors"))
    save_file(rest, str(target_dir / "b.safetensors"))
    (target_dir / "model.safetensors").unlink()
    weight_map = {**{n: "a.safetensors" for n in half}, **{n: "b.safetensors" for n in rest}}
    (target_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_target(target_dir)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), target.state_dict().values()))
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(target_dir / "c.safetensors"))
    (target_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {**weight_map, "x": "c.safetensors"}}))
    with pytest.raises(BlockspecError, match="'model.norm.weight' appears in both"):
        load_target(target_dir)


# -- malformed headers ----------------------------------------------------------------------------

def write_raw(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("header, data, message", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside the file"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "its shape"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
    ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "unknown dtype"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "malformed shape"),
])
def test_malformed_headers_refused(target_dir, header, data, message):
    write_raw(target_dir, header, data)
    with pytest.raises(BlockspecError, match=message):
        load_target(target_dir)


def test_header_length_beyond_the_file_refused(target_dir):
    (target_dir / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(BlockspecError, match="header length"):
        load_target(target_dir)


def test_truncated_file_refused(target_dir):
    data = (target_dir / "model.safetensors").read_bytes()
    (target_dir / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(BlockspecError, match="cannot read"):
        load_target(target_dir)


# -- construction on the meta device, loading equal to the file -------------------------------------

def test_no_random_initialisation_when_loading(target_dir, draft_dir, target, monkeypatch):
    def init_called(*args, **kwargs):
        raise AssertionError("random initialisation ran on real memory")
    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        real = getattr(torch.nn.init, name)
        monkeypatch.setattr(torch.nn.init, name,
                            lambda t, *args, _real=real, **kw: _real(t, *args, **kw) if t.is_meta else init_called())
    load_target(target_dir)
    load_draft(draft_dir, target=target)


@pytest.mark.parametrize("chunk", [None, 96])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_loaded_weights_equal_the_file(target_dir, draft_dir, target, monkeypatch, chunk, dtype):
    """Straight reads (same dtype) and staged casts, whole tensors or many small chunks."""
    if chunk:
        monkeypatch.setattr("blockspec.models.weights.CHUNK_BYTES", chunk)
    model = load_target(target_dir, dtype=dtype)
    file = load_file(str(target_dir / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in file.items():
        assert torch.equal(state[name.removeprefix("model.")], tensor.to(getattr(torch, dtype))), name
    assert model.lm_head.weight is model.embed_tokens.weight
    draft = load_draft(draft_dir, dtype=dtype, target=target)
    dstate = draft.state_dict()
    for name, tensor in load_file(str(draft_dir / "model.safetensors")).items():
        assert torch.equal(dstate[name], tensor.to(getattr(torch, dtype))), name


def test_untied_lm_head_and_old_rotary_buffers(tmp_path):
    target = make_target(model_type="llama")
    save_target(target, tmp_path / "l")
    rewrite(tmp_path / "l", lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    loaded = load_target(tmp_path / "l")
    assert loaded.lm_head.weight is not loaded.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, target(ids).logits)


def test_draft_dtype_follows_the_target(draft_dir, target):
    assert load_draft(draft_dir, target=target.to(torch.bfloat16)).dtype == torch.bfloat16
    assert load_draft(draft_dir).dtype == torch.float32


def test_peak_memory_of_a_load_stays_near_the_weights(tmp_path):
    """Loading a float32 checkpoint adds about the weights once (no full-file copy, no
    second model), measured in a fresh process."""
    target = make_target(vocab=16384, layers=2, hidden_size=512, intermediate_size=2048, num_attention_heads=4,
                         head_dim=128)  # 64 MB of float32 weights
    save_target(target, tmp_path / "big")
    weights = sum(p.numel() * 4 for p in {id(p): p for p in target.parameters()}.values())
    code = ("import resource, sys, torch; from blockspec.models.checkpoint import load_target;"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
            "m = load_target(sys.argv[1]);"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 1.25 * weights + (32 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_load_has_no_cpu_prepacked_copies(target_dir):
    """Weights load straight to the GPU; the CPU-only oneDNN prepacked copies are never made there."""
    from blockspec.models.layers import FusedLinears
    model = load_target(target_dir, dtype="auto", device="cuda")
    assert model.device.type == "cuda" and all(p.is_cuda for p in model.parameters())
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]], device="cuda"))
    fused = [v for m in model.modules() for v in vars(m).values() if isinstance(v, FusedLinears)]
    assert fused and all(f.packed is None for f in fused)
