"""models.tokenizer / models.chat_template: chat prompts and BOS exactly as transformers makes them,
templates found where transformers finds them, hostile templates refused with nothing executed."""

from __future__ import annotations

import datetime
import json

import pytest
from transformers import PreTrainedTokenizerFast

from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import RenderedChat, Tokenizer
from chat_helpers import CHATS, FAMILIES, TOOLS, write_chat_tokenizer

CASES = [(family, chat, tools, gen) for family in FAMILIES for chat in CHATS for tools in (None, TOOLS)
         for gen in (True, False)]


def supported(family: str, chat: str) -> bool:
    """Conversations the family's template accepts (Mistral's refuses tool turns: tested below)."""
    return not (family == "mistral" and chat == "tool_call")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, transformers') tokenizers of each family, from the same files."""
    cache = {}

    def get(family: str, template_in: str = "config"):
        if (family, template_in) not in cache:
            d = write_chat_tokenizer(tmp_path_factory.mktemp(family), family, template_in)
            cache[family, template_in] = Tokenizer(d), PreTrainedTokenizerFast.from_pretrained(str(d))
        return cache[family, template_in]
    return get


def same_day(fn):
    """Run fn twice if the date changed while it ran (templates may print today's date)."""
    for _ in range(2):
        day = datetime.date.today()
        out = fn()
        if datetime.date.today() == day:
            return out
    return out


@pytest.mark.parametrize("family, chat, tools, gen", [c for c in CASES if supported(*c[:2])])
def test_rendering_and_ids_match_transformers(pair, family, chat, tools, gen):
    ours, hf = pair(family)
    messages = CHATS[chat]
    text, expected = same_day(lambda: (
        ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools),
        hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)))
    assert isinstance(text, RenderedChat) and text == expected
    ids, expected_ids = same_day(lambda: (
        ours.encode_chat(messages, add_generation_prompt=gen, tools=tools),
        hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=False)))
    assert ids == list(expected_ids)


def test_template_variables_reach_the_template(pair):
    ours, hf = pair("qwen3")
    messages = CHATS["single"]
    assert ours.apply_chat_template(messages, enable_thinking=False) == hf.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert ours.apply_chat_template(messages, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    ours, hf = pair("llama3.1")
    assert ours.apply_chat_template(messages, date_string="01 Jan 2030") == hf.apply_chat_template(
        messages, add_generation_prompt=True, date_string="01 Jan 2030", tokenize=False)


def test_strftime_now_prints_today(pair):
    ours, _ = pair("llama3.1")
    text = same_day(lambda: (ours.apply_chat_template(CHATS["single"]), datetime.datetime.now())[0])
    assert "Today Date: " + datetime.datetime.now().strftime("%d %b %Y") in text


@pytest.mark.parametrize("family", FAMILIES)
def test_completions_get_bos_exactly_as_the_tokenizer_adds_it(pair, family):
    ours, hf = pair(family)
    for text in ("def f(x):\n    return x", " leading space é€ 😀", "<s>literal", ""):
        assert ours.encode(text) == hf(text)["input_ids"]
    bos, adds_bos = FAMILIES[family][2], FAMILIES[family][4]
    assert (ours.bos_token_id is not None and ours.encode("hi")[0] == ours.bos_token_id) == adds_bos
    assert ours.decode(ours.encode("hi é")) == "hi é"


@pytest.mark.parametrize("family", ["llama3.1", "mistral"])
def test_a_chat_prompt_has_exactly_one_bos(pair, family):
    ours, _ = pair(family)
    bos = ours.backend.token_to_id(FAMILIES[family][2])
    ids = ours.encode_chat(CHATS["multi"] if family == "llama3.1" else CHATS["system"])
    assert ids[0] == bos and ids.count(bos) == 1
    rendered = ours.apply_chat_template(CHATS["single"])
    assert ours.encode(rendered).count(bos) == 1                 # RenderedChat: nothing added
    assert ours.encode(str(rendered)).count(bos) == 2            # the same text as a completion: as HF


def test_mistral_closes_assistant_turns_with_eos(pair):
    ours, hf = pair("mistral")
    text = ours.apply_chat_template(CHATS["multi"])
    assert text == "<s> [INST] Hi [/INST] Hello! <b>ok</b></s> [INST]   Tell me more\n [/INST]"
    assert text == hf.apply_chat_template(CHATS["multi"], add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("family, messages, message", [
    ("mistral", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "must alternate"),
    ("mistral", CHATS["tool_call"], "must alternate"),
    ("llama3.1", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}, {"function": {"name": "g", "arguments": {}}}]}],
     "single tool-calls"),
])
def test_raise_exception_is_a_clear_error(pair, family, messages, message):
    ours, hf = pair(family)
    with pytest.raises(BlockspecError, match=f"chat template failed: .*{message}"):
        ours.apply_chat_template(messages)
    with pytest.raises(Exception, match=message):
        hf.apply_chat_template(messages, tokenize=False)


def test_chat_template_jinja_takes_priority_like_transformers(pair, tmp_path):
    ours, hf = pair("qwen2.5", "jinja")
    assert ours.chat_template == FAMILIES["qwen2.5"][0] == hf.chat_template
    d = write_chat_tokenizer(tmp_path / "both", "qwen2.5", "jinja")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'stale' }}"}))
    assert Tokenizer(d).apply_chat_template(CHATS["single"]) == PreTrainedTokenizerFast.from_pretrained(
        str(d)).apply_chat_template(CHATS["single"], add_generation_prompt=True, tokenize=False)


def test_named_templates_pick_tool_use_with_tools(tmp_path):
    d = write_chat_tokenizer(tmp_path, "qwen2.5")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ 'plain:' + messages[0]['content'] }}"},
                               {"name": "tool_use", "template": "{{ 'tools:' + tools[0]['function']['name'] }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer(d), PreTrainedTokenizerFast.from_pretrained(str(d))
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(CHATS["single"], tools=tools) == hf.apply_chat_template(
            CHATS["single"], tools=tools, add_generation_prompt=True, tokenize=False)
    assert Tokenizer(d, chat_template="tool_use").apply_chat_template(CHATS["single"], tools=TOOLS) == \
        "tools:get_weather"


def test_chat_template_override_file_inline_and_errors(tmp_path):
    d = write_chat_tokenizer(tmp_path / "tok", "qwen2.5")
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}")
    assert Tokenizer(d, chat_template=str(f)).apply_chat_template(CHATS["single"]) == \
        "[user]Hello there, how are you?\n"
    inline = Tokenizer(d, chat_template="{{ bos_token or '' }}{{ messages[0]['content'] }}\\n\u00e9\u20ac")
    assert inline.apply_chat_template(CHATS["single"]) == "Hello there, how are you?\né€"  # escapes decoded, as vLLM
    with pytest.raises(BlockspecError, match="no such file"):
        Tokenizer(d, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(BlockspecError, match="does not parse"):
        Tokenizer(d, chat_template="{% for m in messages %}")
    bare = tmp_path / "bare"
    write_chat_tokenizer(bare, "qwen2.5")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(BlockspecError, match="no chat template"):
        Tokenizer(bare).apply_chat_template(CHATS["single"])


HOSTILE = [
    "{{ lipsum.__globals__['os'].system('touch {marker}') }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% endfor %}{{ 'touch {marker}' }}",
    "{{ (''|attr('__class__')) }}{{ 'touch {marker}' }}",
    "{{ namespace['__init__'] }}{{ 'touch {marker}' }}",
    "{{ joiner.__init__.__globals__['__builtins__']['__import__']('os').system('touch {marker}') }}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_templates_are_refused_and_run_nothing(tmp_path, template):
    marker = tmp_path / "pwned"
    d = write_chat_tokenizer(tmp_path / "tok", "qwen2.5")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = template.replace("{marker}", str(marker))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(BlockspecError, match="reaches for Python internals"):
        Tokenizer(d)
    with pytest.raises(BlockspecError, match="reaches for Python internals"):
        Tokenizer(write_chat_tokenizer(tmp_path / "ok", "qwen2.5"),
                  chat_template=template.replace("{marker}", str(marker)))
    assert not marker.exists()


def test_dynamic_escapes_stay_inside_the_sandbox(tmp_path):
    """What a static check cannot see (names built at run time) the sandbox neutralises."""
    marker = tmp_path / "pwned"
    d = write_chat_tokenizer(tmp_path / "tok", "qwen2.5")
    attr = "'_' ~ '_globals__'"
    tok = Tokenizer(d, chat_template=f"{{{{ (lipsum|attr({attr}))['os'].system('touch {marker}') }}}}")
    with pytest.raises(BlockspecError, match="chat template"):
        tok.apply_chat_template(CHATS["single"])
    tok = Tokenizer(d, chat_template="{{ messages.append(1) }}")  # mutating the input: immutable sandbox
    with pytest.raises(BlockspecError, match="sandbox"):
        tok.apply_chat_template(CHATS["single"])
    assert not marker.exists()


def test_embedded_tokenizer_unchanged():
    """The shipped tokenizer adds nothing to completions (no post-processor) and its template renders."""
    from blockspec import embedded
    tok = Tokenizer(embedded.default_target())
    ids = tok.encode("def f():")
    assert tok.decode(ids) == "def f():" and tok.bos_token_id is None
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
