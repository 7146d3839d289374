"""Every command the README shows runs as written, at toy size (issue 30).

The README's ```bash blocks are parsed; each `blockspec ...` line (and each `torchrun ... -m
blockspec.cli ...` line) must have an entry in TOY, which only swaps the README's placeholder
paths for real ones (the shipped pair, files written here) and appends flags that shrink the run
(argparse keeps the last value of a repeated flag). A README command without an entry fails
`test_every_readme_command_has_a_toy_run`, so the README cannot drift from what runs.
The ```python blocks run too (the OpenAI client one against the served pair).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ASSETS = ROOT / "src" / "blockspec" / "assets"
BIN = Path(sys.executable).parent
TIMEOUT = 600


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def readme_commands() -> list[str]:
    """The README's blockspec command lines, continuation lines joined, comments dropped,
    each as its shlex words re-joined (one spelling per command)."""
    commands = []
    for block in readme_blocks("bash"):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["blockspec"] or (words[:1] == ["torchrun"] and "blockspec.cli" in words):
                commands.append(shlex.join(words))
    return commands


# README command -> (placeholder substitutions, appended toy-size flags). The placeholders:
# TARGET / DIR / ~/models/Qwen3-8B are a target directory, DRAFT a draft directory, `...` the
# previous train command's arguments, ports and dataset files what this test serves and writes;
# a list replaces a placeholder's occurrences in order.
GEN = ["--max-new-tokens", "8"]
TRAIN = ["--max-steps", "2", "--batch-size", "2", "--max-len", "96", "--num-layers", "1",
         "--eval-every", "1000", "--save-every", "1000", "--threads", "1"]
_TOY: dict[str, tuple[dict[str, str | list[str]], list[str]]] = {
    "blockspec generate 'def fib(n):'": ({}, GEN),
    "blockspec generate 'def fib(n):' --method dflash": ({}, GEN),
    "blockspec generate 'def fib(n):' --method dspark --block-size 8": ({}, GEN),
    "blockspec generate 'def fib(n):' --compile": ({}, GEN),
    "blockspec generate 'import os' --temperature 0.8 --top-p 0.95 --seed 1": ({}, GEN),
    "blockspec generate Hello --target /path/to/Qwen3-8B --draft /path/to/Qwen3-8B-DFlash-b16 --method dflash":
        ({"/path/to/Qwen3-8B": "{target}", "/path/to/Qwen3-8B-DFlash-b16": "{dflash}"}, GEN),
    "blockspec generate 'def fib(n):' --method dflash --no-adapt": ({}, GEN),
    "blockspec serve --method dflash --port 8000": ({"8000": "{port}"}, []),
    "blockspec launch-line DRAFT --target TARGET --engine vllm": ({"DRAFT": "{dflash}", "TARGET": "{target}"}, []),
    "blockspec launch-line DRAFT --target TARGET --engine sglang": ({"DRAFT": "{dspark}", "TARGET": "{target}"}, []),
    "blockspec launch-line DRAFT --target TARGET --engine blockspec":
        ({"DRAFT": "{dflash}", "TARGET": "{target}"}, []),
    "blockspec regenerate --prompts prompts.jsonl --out runs/regen.jsonl --target DIR":
        ({"DIR": "{target}"}, ["--max-new-tokens", "24"]),
    "blockspec train --method dflash --target DIR --data runs/regen.jsonl --out runs/dflash --block-size 16 "
    "--init-from-target": ({"DIR": "{target}"}, TRAIN),
    "torchrun --nproc_per_node 2 -m blockspec.cli train ...": ({"...": "{previous_train}"}, []),
    "blockspec regenerate --endpoint http://localhost:8000 --prompts ShareGPT_V3_unfiltered_cleaned_split.json "
    "--out runs/regen.jsonl --concurrency 64 --max-new-tokens 2048 --extra-body "
    "'{\"chat_template_kwargs\": {\"enable_thinking\": false}}'":
        ({"http://localhost:8000": "http://127.0.0.1:{port}"}, ["--max-new-tokens", "24"]),
    "torchrun --nproc_per_node 8 -m blockspec.cli train --method dflash --target ~/models/Qwen3-8B --data "
    "runs/regen.jsonl --out runs/qwen3-dflash --block-size 16 --num-layers 5 --max-len 3072":
        ({"8": "2", "~/models/Qwen3-8B": "{target}"}, TRAIN),
    "blockspec serve --target ~/models/Qwen3-8B --draft runs/qwen3-dflash/draft --method dflash":
        ({"~/models/Qwen3-8B": "{target}"}, ["--port", "{port}"]),
    "blockspec bench --datasets humaneval,heldout --temperatures 0,1 --out docs/bench":
        ({}, ["--limit", "1", "--max-new-tokens", "8", "--repeats", "1", "--no-progress"]),
    "blockspec profile --out runs/cost_table.json --draft embedded --tokens 1,2,4,8,16,32,64,128,256,512": ({}, []),
    "blockspec profile --refresh --draft embedded": ({}, []),
    "blockspec generate 'def fib(n):' --method eagle3 --block-size 6": ({}, GEN),
    "blockspec generate 'def fib(n):' --method eagle3 --no-adapt --speculative-eagle-topk 4 --speculative-num-steps 5 "
    "--speculative-num-draft-tokens 12": ({}, GEN),
    "blockspec train ... --num-layers 2 --draft-sliding-window 512 --draft-layer-types "
    "sliding_attention,full_attention": ({"...": "{previous_train}"}, ["--out", "runs/dflash-window"]),
    "blockspec bench --methods ar,eagle3,dflash,dspark --eagle3-draft DIR --dflash-draft DIR --dspark-draft DIR":
        ({"DIR": ["{eagle3}", "{dflash}", "{dspark}"]},
         ["--datasets", "humaneval", "--limit", "1", "--max-new-tokens", "8", "--repeats", "1", "--no-progress",
          "--out", "runs/bench-eagle3"]),
    "blockspec calibrate --draft DIR --prompts runs/corpus":
        ({"DIR": "{dspark_copy}"}, ["--num-prompts", "8", "--max-new-tokens", "16", "--force"]),
}
TOY = {shlex.join(shlex.split(command)): toy for command, toy in _TOY.items()}


def toy_argv(command: str, values: dict[str, str]) -> list[str]:
    subs, extra = TOY[command]
    queues = {k: list(v) for k, v in subs.items() if isinstance(v, list)}   # a placeholder given several times
    words = []
    for word in shlex.split(command):
        if word in subs:
            value = (queues[word].pop(0) if word in queues else subs[word]).format(**values)
            words.extend(shlex.split(value) if word == "..." else [value])
        else:
            words.append(word)
    words += [w.format(**values) for w in extra]
    exe = str(BIN / words[0])
    return [exe] + words[1:]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """A README `blockspec serve` command as a process, until /health answers."""

    def __init__(self, argv: list[str], cwd: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{shlex.join(argv)} exited {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise AssertionError(f"{shlex.join(argv)}: no /health within 300 s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def curl_body() -> dict:
    """The JSON body of the README's curl example."""
    block = next(b for b in readme_blocks("bash") if "curl" in b)
    return json.loads(re.search(r"-d '(\{.*?\})'", block).group(1))


@pytest.fixture
def workdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working directory with the files the README's commands read, and the placeholder values."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                                    ["def add(a, b):", "class Stack:", "import os\n\ndef walk("]))
    convs = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]}
             for q in ["Write a function that adds two numbers.", "Sort a list.", "Reverse a string."]]
    (tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(convs))
    corpus = tmp_path / "runs" / "corpus"
    corpus.mkdir(parents=True)
    for split in ("train", "val"):
        rows = [{"path": f"{split}{i}.py", "text": f"def f{i}(x, y):\n    return x * {i} + y - {i % 7}\n\n" * 20}
                for i in range(12)]   # long enough for calibrate's prompt windows (> 80 tokens)
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copytree(ASSETS / "dspark", tmp_path / "dspark")   # calibrate writes beside its draft
    values = {"target": str(ASSETS / "target"), "dflash": str(ASSETS / "dflash"), "dspark": str(ASSETS / "dspark"),
              "dspark_copy": str(tmp_path / "dspark")}
    return tmp_path, values


def commands_where(pattern: str) -> list[str]:
    return [c for c in readme_commands() if re.search(pattern, c)]


def test_every_readme_command_has_a_toy_run():
    commands = readme_commands()
    assert len(commands) >= 15, "the README's command parser found too few commands"
    assert [c for c in commands if c not in TOY] == []
    assert [c for c in TOY if c not in commands] == []


def test_readme_generate_and_launch_lines(workdir):
    cwd, values = workdir
    for command in commands_where(r"^blockspec (generate|launch-line)"):
        if "--compile" in command:
            continue   # compiling takes a minute (test_readme_compiled_generate)
        proc = run(toy_argv(command, values), cwd)
        if "launch-line" in command:
            assert values["target"] in proc.stdout
        else:
            assert proc.stdout.strip(), command


@pytest.mark.slow
def test_readme_compiled_generate(workdir):
    cwd, values = workdir
    (command,) = commands_where(r"--compile$")
    assert run(toy_argv(command, values), cwd).stdout.strip()


def test_readme_python_api_block():
    block = next(b for b in readme_blocks("python") if "load_target" in b)
    proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the completion alone: the prompt is not echoed (a small greedy target may write it again later)
    assert proc.stdout.strip() and not proc.stdout.startswith("def fib(n):")


@pytest.mark.slow
def test_readme_train_recipe_in_process(workdir):
    """regenerate -> train -> the same train under torchrun, as the README's 'Train a drafter'."""
    cwd, values = workdir
    run(toy_argv(commands_where(r"^blockspec regenerate --prompts")[0], values), cwd)
    assert len((cwd / "runs" / "regen.jsonl").read_text().splitlines()) == 3
    (train,) = commands_where(r"^blockspec train --method dflash")
    argv = toy_argv(train, values)
    run(argv, cwd)
    assert (cwd / "runs" / "dflash" / "draft" / "config.json").is_file()
    values["previous_train"] = shlex.join(argv[2:] + ["--out", "runs/dflash-ddp"])
    run(toy_argv(commands_where(r"^torchrun .* train \.\.\.$")[0], values), cwd)
    assert (cwd / "runs" / "dflash-ddp" / "draft" / "config.json").is_file()
    values["previous_train"] = shlex.join(argv[2:])
    run(toy_argv(commands_where(r"^blockspec train \.\.\. .*--draft-sliding-window")[0], values), cwd)
    window = json.loads((cwd / "runs" / "dflash-window" / "draft" / "config.json").read_text())
    assert window["layer_types"] == ["sliding_attention", "full_attention"]
    # The README's side-by-side bench with an EAGLE-3 draft trained here (as a user's would be).
    run([str(BIN / "blockspec"), "train", "--method", "eagle3", "--target", values["target"], "--data",
         "runs/regen.jsonl", "--out", "runs/eagle3", *TRAIN], cwd)
    values["eagle3"] = str(cwd / "runs" / "eagle3" / "draft")
    run(toy_argv(commands_where(r"^blockspec bench --methods ar,eagle3")[0], values), cwd)
    assert (cwd / "runs" / "bench-eagle3" / "results.json").is_file()


@pytest.mark.slow
def test_readme_serve_endpoint_recipe(workdir):
    """serve -> curl body and the OpenAI client block -> regenerate --endpoint -> torchrun train ->
    serve the trained draft, as the README's 'Serve' and Hugging Face recipe."""
    cwd, values = workdir
    values["port"] = str(free_port())
    server = Served(toy_argv("blockspec serve --method dflash --port 8000", values), cwd, int(values["port"]))
    try:
        answer = httpx.post(server.url + "/v1/completions", json=curl_body(), timeout=300)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
        client_block = next(b for b in readme_blocks("python") if "OpenAI(" in b).replace("8000", values["port"])
        proc = subprocess.run([sys.executable, "-c", client_block], capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
        run(toy_argv(commands_where(r"^blockspec regenerate --endpoint")[0], values), cwd)
    finally:
        server.close()
    rows = [json.loads(line) for line in (cwd / "runs" / "regen.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    run(toy_argv(commands_where(r"^torchrun --nproc_per_node 8 ")[0], values), cwd)
    values["port"] = str(free_port())
    server = Served(toy_argv(commands_where(r"^blockspec serve --target")[0], values), cwd, int(values["port"]))
    try:
        body = dict(curl_body(), model=values["target"], max_tokens=8)   # served under --target, as vLLM does
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
    finally:
        server.close()


@pytest.mark.slow
def test_readme_measure_commands(workdir):
    cwd, values = workdir
    run(toy_argv(commands_where(r"^blockspec bench ")[0], values), cwd)
    assert (cwd / "docs" / "bench" / "results.json").is_file()
    run(toy_argv(commands_where(r"^blockspec profile --out")[0], values), cwd)
    assert json.loads((cwd / "runs" / "cost_table.json").read_text())
    assert "measured" in run(toy_argv(commands_where(r"^blockspec profile --refresh")[0], values), cwd).stderr
    run(toy_argv(commands_where(r"^blockspec calibrate ")[0], values), cwd)
    calibrated = json.loads((cwd / "dspark-calibrated" / "config.json").read_text())
    assert calibrated != json.loads((cwd / "dspark" / "config.json").read_text())
