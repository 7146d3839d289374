"""Chat templates render in bounded worker processes: a looping or giant template is a
BlockspecError naming it, within its deadline, while other renders go on; any exception a
template raises is one of those errors."""

from __future__ import annotations

import threading
import time

import pytest

from blockspec.errors import BlockspecError
from blockspec.models import chat_template as templates
from blockspec.models import template_sandbox
from blockspec.models.template_sandbox import WORKERS

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
CHAT = [{"role": "user", "content": "hi"}]


def render(template: str, **kw) -> str:
    return templates.render(template, CHAT, add_generation_prompt=False, special_tokens={}, where="test.jinja", **kw)


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch):
    monkeypatch.setattr(template_sandbox, "RENDER_TIMEOUT_S", 0.5)


def start_every_worker() -> None:
    """Every worker started (each imports transformers), so the timings below are renders."""
    threads = [threading.Thread(target=render, args=(PLAIN,)) for _ in range(WORKERS.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture(scope="module", autouse=True)
def warm_workers():
    start_every_worker()


def test_a_looping_template_ends_at_its_deadline_while_another_render_is_answered():
    WORKERS.close()   # whatever earlier tests left (a killed worker restarts on its next render)
    start_every_worker()
    failed: list[str] = []

    def hostile() -> None:
        with pytest.raises(BlockspecError) as err:
            render(LOOP)
        failed.append(str(err.value))

    t0 = time.monotonic()
    thread = threading.Thread(target=hostile)
    thread.start()
    time.sleep(0.1)
    assert render(PLAIN) == "<user>hi"   # answered while the hostile render is stuck
    answered = time.monotonic() - t0
    thread.join(30)
    assert answered < 0.5 and failed and "took longer than 0.5 s" in failed[0] and "test.jinja" in failed[0]
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("template, reason", [
    ("{{ 'x' * 10**9 }}", "MemoryError|memory|took longer"),      # 1 GB: over the worker's memory cap
    ("{% set x = [0] * 10**9 %}{{ x | length }}", "MemoryError|memory|took longer"),
    ("{% for i in range(10**7) %}{% endfor %}", "OverflowError"),   # jinja's range cap
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
])
def test_any_exception_of_a_template_is_an_error_naming_it(template, reason):
    t0 = time.monotonic()
    with pytest.raises(BlockspecError, match=f"chat template failed: ({reason}).*test.jinja"):
        render(template)
    assert time.monotonic() - t0 < 15


def test_the_output_is_capped():
    assert render("{{ 'x' * 100 }}", max_chars=100) == "x" * 100
    with pytest.raises(BlockspecError, match="exceeds 100 characters"):
        render("{{ 'x' * 101 }}", max_chars=100)


def test_close_kills_a_render_in_flight_at_once():
    failed: list[str] = []

    def hostile() -> None:
        with pytest.raises(BlockspecError) as err:
            template_sandbox.WORKERS.render({"template": LOOP, "messages": CHAT, "tools": None, "documents": None,
                                             "add_generation_prompt": False, "max_chars": 100, "spans": False,
                                             "kwargs": {}}, "test.jinja", timeout=60)
        failed.append(str(err.value))

    thread = threading.Thread(target=hostile)
    thread.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    WORKERS.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - t0 < 2 and "stopped" in failed[0]
    assert render(PLAIN) == "<user>hi"   # a fresh worker
