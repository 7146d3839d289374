"""`python slow_server.py TARGET_DIR PORT DRAIN_TIMEOUT [FLAGS...]`: `blockspec serve`'s own
run_server on the tiny target, with every engine step slowed to STEP_S seconds, so a
request of 100 tokens is still running when the test sends SIGTERM / SIGINT."""

from __future__ import annotations

import logging
import sys
import time

from blockspec.engine.engine import Engine
from blockspec.serving.api import create_app
from blockspec.serving.runner import run_server
from blockspec.serving.server import add_serve_arguments, build_engine
from blockspec import EngineOptions

STEP_S = 0.1


class SlowEngine(Engine):
    def step(self) -> bool:
        time.sleep(STEP_S)
        return super().step()


def main() -> None:
    import argparse

    target_dir, port, drain = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--target", target_dir, "--max-model-len", "128", "--max-running", "4",
                              "--kv-memory-gb", "1", *sys.argv[4:]])
    logging.basicConfig(level="INFO", format="%(levelname)s: %(name)s: %(message)s")
    built, tokenizer, _ = build_engine(args)
    engine = SlowEngine(built.target, max_running=built.rows, max_model_len=built.max_model_len,
                        tokenizer=tokenizer, options=EngineOptions(kv_memory_gb=1.0))
    run_server(create_app(engine, tokenizer, "tiny"), "127.0.0.1", port, drain, "info")


if __name__ == "__main__":
    main()
