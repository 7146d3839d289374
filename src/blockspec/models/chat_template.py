"""Chat templates: found where transformers finds them, refused when they reach for Python
internals, and rendered by transformers' own renderer (its immutable sandbox, `trim_blocks` /
`lstrip_blocks`, `raise_exception`, `strftime_now`, `tojson`, `tools`, `documents`, the special
tokens), so a prompt is byte-identical to `tokenizer.apply_chat_template(..., tokenize=False)`.

Checkpoints come from strangers: a template is parsed and checked before it is ever rendered,
and it is only ever rendered inside transformers' ImmutableSandboxedEnvironment, where any
dynamic attempt the static check cannot see renders as undefined (empty) and executes nothing,
in a worker process with a deadline and memory and output caps (template_sandbox.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from blockspec.config import read_json
from blockspec.config.common import resolve_inside, side_file
from blockspec.errors import BlockspecError
from blockspec.models.template_sandbox import MAX_CHARS, WORKERS

TEMPLATE_FILE = "chat_template.jinja"          # where transformers >= 4.50 saves the default template
TEMPLATE_DIR = "additional_chat_templates"     # ... and named extra templates (<name>.jinja)
MAX_TEMPLATE_BYTES = 4 << 20                   # real templates are a few kilobytes

# Attributes that only lead to interpreter internals (frames, code objects, globals); jinja's
# sandbox hides them at run time, but a template naming one is hostile and refused outright.
_INTERNAL_ATTRIBUTES = frozenset({"mro", "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code",
                                  "f_globals", "f_locals", "f_builtins", "f_back", "f_code", "tb_frame",
                                  "tb_next", "func_globals", "func_code"})


def _internal(name: Any) -> bool:
    return isinstance(name, str) and (name.startswith("__") or name in _INTERNAL_ATTRIBUTES)


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' `{% generation %}...{% endgeneration %}` (assistant-mask markers) so the
    check below can read templates that use it; rendering is transformers' own."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


# Parsing only (never rendering): the same syntax options and extensions transformers compiles with.
_PARSER = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])


def check_template(template: str, where: str) -> str:
    """Parse `template`; refuse it if it does not parse or names a Python internal
    (`x.__class__`, `lipsum.__globals__`, `x['__init__']`, `x|attr('__class__')`, `.mro`...)."""
    if not isinstance(template, str) or not template.strip():
        raise BlockspecError(f"chat template ({where}) must be a non-empty string")
    try:
        ast = _PARSER.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise BlockspecError(f"chat template ({where}) does not parse: {exc.message} (line {exc.lineno})") from None
    for node in ast.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Filter, jinja2.nodes.Test)):
        if isinstance(node, jinja2.nodes.Getattr):
            names = [node.attr]
        elif isinstance(node, jinja2.nodes.Getitem):
            names = [node.arg.value] if isinstance(node.arg, jinja2.nodes.Const) else []
        else:  # |attr('__x__'), |map(attribute='__x__'), is sameas ... : constant arguments
            args = list(node.args) + [kw.value for kw in node.kwargs]
            names = [a.value for a in args if isinstance(a, jinja2.nodes.Const)]
        bad = next((n for n in names if _internal(n)), None)
        if bad is not None:
            raise BlockspecError(f"chat template ({where}) reaches for Python internals ({bad!r} on line "
                                 f"{node.lineno}); refusing to use it (pass --chat-template FILE to use another)")
    return template


def load_templates(directory: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """{name: template} as transformers loads them: `chat_template.jinja` (+ `additional_chat_templates/
    *.jinja`) take priority over `chat_template` in tokenizer_config.json (a string, or a list of
    {"name", "template"}). The unnamed template is "default". Every template is checked."""
    templates: dict[str, str] = {}
    if (directory / TEMPLATE_FILE).is_file():
        templates["default"] = _read_text(side_file(directory / TEMPLATE_FILE, "chat template", MAX_TEMPLATE_BYTES))
    if (directory / TEMPLATE_DIR).is_dir():
        resolve_inside(directory, directory / TEMPLATE_DIR, "chat template")
        for path in sorted((directory / TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = _read_text(side_file(path, "chat template",
                                                                               MAX_TEMPLATE_BYTES))
    if not templates:
        value = tokenizer_config.get("chat_template")
        if isinstance(value, str):
            templates["default"] = value
        elif isinstance(value, list):
            for entry in value:
                if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                        and isinstance(entry.get("template"), str)):
                    raise BlockspecError("tokenizer_config.json: a list 'chat_template' needs "
                                         "{\"name\", \"template\"} string entries")
                templates[entry["name"]] = entry["template"]
        elif value is not None:
            raise BlockspecError("tokenizer_config.json: 'chat_template' must be a string or a list of "
                                 f"named templates, got {type(value).__name__}")
    return {name: check_template(text, f"{directory}: {name}") for name, text in templates.items()}


def resolve_override(value: str | Path, templates: dict[str, str]) -> str:
    """`--chat-template`, as vLLM reads it: a file to read; else, when it has template characters
    ({, } or a newline), the template itself with its backslash escapes decoded; else the name of
    one of the checkpoint's own templates (as transformers' `chat_template=` argument)."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a long inline template is not a valid path name
        is_file = False
    if is_file:
        return check_template(_read_text(path), str(path))
    if isinstance(value, Path):
        raise BlockspecError(f"chat template file {value} does not exist")
    if value in templates:
        return templates[value]
    if not any(c in value for c in "{}\n"):
        raise BlockspecError(f"--chat-template {value!r}: no such file (and not a template or one of this "
                             f"model's named templates {sorted(templates)})")
    try:  # vLLM's reading of an inline template (its escapes decoded), keeping non-ASCII characters intact
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except (UnicodeError, ValueError):
        text = value
    return check_template(text, "--chat-template")


def pick(templates: dict[str, str], tools: list[Any] | None) -> str:
    """The template transformers would use: "tool_use" when tools are given and it exists, else "default"."""
    if not templates:
        raise BlockspecError("this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json); "
                             "pass --chat-template FILE")
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise BlockspecError(f"this tokenizer has several chat templates and no default: {sorted(templates)}; "
                         "pass --chat-template NAME")


def render(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
           special_tokens: dict[str, str], tools: list[dict[str, Any]] | None = None,
           documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    """The prompt text, exactly as transformers' `apply_chat_template(..., tokenize=False)` renders it."""
    return render_with_spans(template, messages, add_generation_prompt=add_generation_prompt,
                             special_tokens=special_tokens, tools=tools, documents=documents,
                             assistant_spans=False, **kwargs)[0]


def has_generation_blocks(template: str) -> bool:
    """Whether the template marks assistant text with `{% generation %}` (transformers' assistant mask)."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def render_with_spans(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                      special_tokens: dict[str, str], assistant_spans: bool = True, where: str = "inline",
                      max_chars: int = MAX_CHARS, **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """`render`, plus the character spans [start, end) of the template's `{% generation %}` blocks
    (transformers' `return_assistant_tokens_mask`); no spans when the template has none. The
    render is bounded (template_sandbox.py): a deadline, a memory cap, at most `max_chars`
    characters; any failure is a BlockspecError naming `where` (the template's source).
    kwargs: the template's variables, `tools` and `documents` among them (transformers' own
    arguments of the same names)."""
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    if not isinstance(messages, list) or not messages:
        raise BlockspecError("a chat needs a non-empty list of messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BlockspecError("each chat message must be an object with a string 'role'")
    # As apply_chat_template: keys whose value is None are dropped (templates test for presence).
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    reply = WORKERS.render({"template": template, "messages": chat, "tools": tools, "documents": documents,
                            "add_generation_prompt": add_generation_prompt, "max_chars": max_chars,
                            "spans": assistant_spans and has_generation_blocks(template),
                            "kwargs": {**special_tokens, **kwargs}}, where)
    return reply["text"], [(a, b) for a, b in reply["spans"]]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BlockspecError(f"chat template: cannot read {path}: {exc}") from None
