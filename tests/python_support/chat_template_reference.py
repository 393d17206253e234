#!/usr/bin/env python3
"""Independent reference renderer of Hugging Face chat templates (issue #15).

Renders a chat template with Python's jinja2 exactly the way `transformers`'
`PreTrainedTokenizerBase.apply_chat_template(..., tokenize=False)` does, so that kvgate's
Rust renderer (minijinja + minijinja-contrib) can be checked against it text for text.

Conventions followed: transformers 5.24.0 (the wheel's
`transformers/utils/chat_template_utils.py`: `_cached_compile_jinja_template`,
`render_jinja_template`, `_alias_reasoning_fields`, `_plain_template_data`; and
`transformers/tokenization_utils_base.py`: `apply_chat_template`, `_normalize_chat_messages`),
with jinja2 3.1.6 (transformers refuses jinja2 < 3.1.6). In detail:

  * environment: `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
    extensions=[<generation tag>, jinja2.ext.loopcontrols])`; keep_trailing_newline stays off
    (so one trailing newline of the template source is dropped);
  * `tojson` filter replaced by `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
    sort_keys=False)` (all four overridable as filter arguments; no HTML escaping);
  * globals `raise_exception(msg)` (raises jinja2 `TemplateError(msg)`), `strftime_now(fmt)`
    (`datetime.now().strftime(fmt)`), `dict` (a callable returning a plain dict, with
    `dict.fromkeys`), and `namespace` (jinja2's Namespace refusing `_`-prefixed attributes);
  * the `{% generation %}...{% endgeneration %}` tag renders its body unchanged (transformers
    only records assistant spans with it, which text rendering does not use);
  * messages: each message must be a dict; keys whose value is null are dropped; a message with
    any of `reasoning_content` / `thinking` / `reasoning` not null becomes
    `{"thinking": r, **message, "reasoning_content": r}` (r = the first of those three present);
  * template variables: `messages`, `tools`, `documents`, `add_generation_prompt`, then the
    special tokens given (`bos_token`, `eos_token`, `unk_token`, `pad_token`; a token that is
    absent or null is left undefined, as transformers' `special_tokens_map` omits unset tokens),
    then every `kwargs` entry (chat_template_kwargs) — kwargs override special tokens;
  * `continue_final_message` (true, or the name of the field to continue): refused with
    `add_generation_prompt`; the final message's field gets the tag `"CONTINUE_FINAL_MESSAGE_TAG "`
    appended (the last text block when the content is a list; every reasoning alias when the
    field is a reasoning field), the template must mention the field by name, and after rendering
    the text is cut at the last `CONTINUE_FINAL_MESSAGE_TAG`, with `.rstrip()` when the
    template did not keep the tag's trailing space; the final message (stripped) and the tag must
    both appear in the render, else ValueError.

Errors are reported as `"<exception class name>: <message>"` (e.g. `TemplateError: ...` from
`raise_exception`, `UndefinedError`, `TemplateSyntaxError`, `ValueError`, `TypeError`).

One extension beyond transformers: a request may carry `"now": "<ISO 8601 datetime>"` to freeze
what `strftime_now` sees (transformers always uses the local current time), so that templates
printing today's date can be compared deterministically.

CLI: reads one JSON request on stdin and writes one JSON result on stdout.
  request: {"template": "...", "messages": [...], "tools": [...]|null, "documents": [...]|null,
            "add_generation_prompt": bool, "continue_final_message": bool|"field",
            "kwargs": {...}, "bos_token": "...", "eos_token": "...", "now": "..."}
  result:  {"ok": true, "text": "..."} or {"ok": false, "error": "Class: message"}
  batch:   {"batch": [request, ...]}  ->  {"batch": [result, ...]}  (same order)
Only the Python standard library and jinja2 are needed (scripts/fetch-fixtures.sh installs it).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TRANSFORMERS_CONVENTIONS = "5.24.0"
CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning is passed under; the first is the standard one templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' AssistantTracker, without the tracking: `{% generation %}` renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


class _TemplateDict:
    # transformers' TemplateDict: `dict(...)` and `dict.fromkeys(...)` without attribute access
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # transformers' TemplateNamespace: refuses underscore-prefixed attributes
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Clock:
    """What `strftime_now` reads: the current local time unless a request froze it."""

    frozen: datetime | None = None

    def strftime_now(self, fmt):
        return (self.frozen or datetime.now()).strftime(fmt)


_CLOCK = _Clock()
_COMPILED: dict[str, jinja2.Template] = {}


def compile_template(source: str) -> jinja2.Template:
    tmpl = _COMPILED.get(source)
    if tmpl is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _CLOCK.strftime_now
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        tmpl = env.from_string(source)
        _COMPILED[source] = tmpl
    return tmpl


def _normalize_messages(messages: Any) -> list[dict]:
    # apply_chat_template: empty conversation refused; _normalize_chat_messages drops null keys
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append({key: value for key, value in message.items() if value is not None})
    return out


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def render(
    template: str,
    messages: list,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    special_tokens: dict | None = None,
    kwargs: dict | None = None,
) -> str:
    """The text `apply_chat_template(messages, tokenize=False, ...)` returns."""
    chat = _normalize_messages(json.loads(json.dumps(messages)))  # a fresh copy, like transformers
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when "
            "you want the model to continue the final message, and add_generation_prompt when you want to add a "
            "header that will prompt it to start a new assistant message instead."
        )
    template_kwargs = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    template_kwargs.update(kwargs or {})

    compiled = compile_template(template)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError(
                    "Tools should either be a JSON schema, or a callable function with type hints "
                    "and a docstring suitable for auto-conversion to a schema."
                )
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")

    chat = _alias_reasoning_fields(chat)
    final_message = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        if (final_message := chat[-1].get(field)) is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        continue_fields = [field]
        if field in REASONING_FIELDS:
            continue_fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final_message]
        if not any(f in template for f in continue_fields):
            raise ValueError(
                f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
            )
        elif isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + CONTINUE_FINAL_MESSAGE_TAG
                    break
            else:
                raise ValueError(
                    "continue_final_message is set but we could not find any text to continue in the final message!"
                )
        else:
            for f in continue_fields:
                chat[-1][f] = chat[-1][f] + CONTINUE_FINAL_MESSAGE_TAG

    text = compiled.render(
        messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **template_kwargs
    )

    if continue_final_message:
        if final_message.strip() not in text or CONTINUE_FINAL_MESSAGE_TAG.strip() not in text:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the chat after "
                "applying the chat template! This can happen if the chat template deletes portions of "
                "the final message. Please verify the chat template and final message in your chat to "
                "ensure they are compatible."
                f"Final message to continue: {final_message.strip()}\nRendered chat:\n{text}"
            )
        tag_loc = text.rindex(CONTINUE_FINAL_MESSAGE_TAG.strip())
        if text[tag_loc : tag_loc + len(CONTINUE_FINAL_MESSAGE_TAG)] == CONTINUE_FINAL_MESSAGE_TAG:
            text = text[:tag_loc]
        else:
            text = text[:tag_loc].rstrip()
    return text


def render_request(req: dict) -> dict:
    """One CLI request -> {"ok": true, "text": ...} | {"ok": false, "error": "Class: message"}."""
    try:
        if not isinstance(req, dict):
            raise TypeError("a request must be a JSON object")
        now = req.get("now")
        _CLOCK.frozen = datetime.fromisoformat(now) if now else None
        text = render(
            template=req["template"],
            messages=req.get("messages"),
            tools=req.get("tools"),
            documents=req.get("documents"),
            add_generation_prompt=bool(req.get("add_generation_prompt", False)),
            continue_final_message=req.get("continue_final_message", False) or False,
            special_tokens={k: req.get(k) for k in SPECIAL_TOKENS},
            kwargs=req.get("kwargs") or {},
        )
        return {"ok": True, "text": text}
    except Exception as e:  # noqa: BLE001 - any failure is a result, like the Rust side's error
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        _CLOCK.frozen = None


def main() -> int:
    try:
        req = json.load(sys.stdin)
    except json.JSONDecodeError as e:
        json.dump({"ok": False, "error": f"JSONDecodeError: {e}"}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        return 2
    if isinstance(req, dict) and "batch" in req:
        out = {"batch": [render_request(r) for r in req["batch"]]}
    else:
        out = render_request(req)
    json.dump(out, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
