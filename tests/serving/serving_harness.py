"""Start the real server (uvicorn on a loopback port, in a thread) on tiny random models."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.models.checkpoint import save_draft  # noqa: E402
from blockspec.serving.api import ServerLimits, create_app  # noqa: E402
from blockspec.serving.runner import server_for  # noqa: E402
from blockspec.serving.server import add_serve_arguments, build_engine  # noqa: E402
from conftest import make_draft, write_tiny_target_dir  # noqa: E402

KEY = "sk-test-key"
MODEL = "tiny"


def write_models(root: Path) -> tuple[Path, Path]:
    """A tiny target (word-level tokenizer, chat template) and a z-lab DFlash draft (block 4)."""
    target_dir, draft_dir = root / "target", root / "draft"
    target = write_tiny_target_dir(target_dir)
    save_draft(make_draft(target, "zlab", block_size=4), draft_dir)
    return target_dir, draft_dir


def serve_args(*flags: str):
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(flags))


def dflash_engine(target_dir: Path, draft_dir: Path, engine_cls: type[Engine] | None = None, **flags: str) -> tuple:
    """(engine, tokenizer, name) through the CLI's own flag handling, float64 for exact greedy checks."""
    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--method", "dflash", "--dtype", "float64",
            "--served-model-name", MODEL, "--max-model-len", "128"]
    for flag, value in flags.items():   # value "": a bare switch such as --no-adapt
        argv += [f"--{flag.replace('_', '-')}"] + ([value] if value else [])
    engine, tokenizer, name = build_engine(serve_args(*argv))
    if engine_cls is not None:  # same models, another Engine class (tests gate its steps)
        engine = engine_cls(engine.target, engine.draft, "dflash", max_running=engine.rows,
                            max_model_len=engine.max_model_len, tokenizer=tokenizer)
    return engine, tokenizer, name


class ServerThread:
    """`with ServerThread(app) as url:` serves `app` until the block ends."""

    def __init__(self, app, drain_timeout: float = 5.0, **timeouts: float) -> None:
        self.app, self.drain_timeout, self.timeouts = app, drain_timeout, timeouts

    def __enter__(self) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        # The server `blockspec serve` runs: the app's drain before the listener closes.
        self.server = server_for(self.app, "127.0.0.1", port, self.drain_timeout, log_level="warning",
                                 **self.timeouts)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start(engine: Engine, tokenizer, api_key: str | None = KEY, **limits) -> tuple[ServerThread, str]:
    ctx = ServerThread(create_app(engine, tokenizer, MODEL, api_key=api_key, limits=ServerLimits(**limits)))
    return ctx, ctx.__enter__()


def metric(text: str, name: str) -> float:
    """One sample of a Prometheus text page, by its name with labels as printed (`name{a="b"}`)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


torch.set_num_threads(1)
