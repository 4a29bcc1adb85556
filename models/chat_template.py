"""A model's chat template, rendered without importing transformers or torch.

`layerbus submit` renders every prompt through the model's chat template; loading transformers'
tokenizer for that imported torch and took seconds, for a command that computes nothing. The
template is Jinja: this renders it the way transformers' `apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)` does (a sandboxed environment with trim_blocks and
lstrip_blocks, its `tojson`, `raise_exception`, `strftime_now`, `dict` and `namespace`, the named
special tokens as variables), and tests/unit/test_chat_template.py checks it against transformers on
every template the tests have. A template this cannot render (one using transformers' own
`{% generation %}` tag, say) is reported as None, and the caller falls back to transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

# The special tokens transformers passes to a template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    """What a tokenizer needs for `apply_chat_template(..., tokenize=False)`; duck-types as one for
    jobs.tasks (which reads `chat_template` and calls `apply_chat_template`)."""

    chat_template: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        if tokenize:
            raise ValueError("ChatTemplate renders text only; tokenize with the model's tokenizer")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        # As transformers does: message keys whose value is None are dropped.
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        return _compiled(self.chat_template).render(messages=messages, tools=None, documents=None,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens)


def read_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model's chat template from `chat_template.jinja` or tokenizer_config.json (an empty one
    when the model has none: prompts then take the plain form), or None where this cannot stand in
    for transformers' tokenizer (no tokenizer files, legacy special_tokens_map.json, several named
    templates, or a template using transformers' extensions): then ask transformers."""
    if not (model_dir / "tokenizer.json").is_file() or _special_tokens_map_file(model_dir):
        return None
    config = _read_json(model_dir / "tokenizer_config.json")
    jinja_file = model_dir / "chat_template.jinja"
    template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else config.get("chat_template")
    if template is None:
        return ChatTemplate("")
    if not isinstance(template, str) or not template:
        return None
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
    try:
        _compiled(template)
    except Exception:  # noqa: BLE001 - any template this environment cannot compile goes to transformers
        return None
    return ChatTemplate(template, {name: text for name, text in special.items() if text is not None})


def _special_tokens_map_file(model_dir: Path) -> bool:
    return (model_dir / "special_tokens_map.json").is_file()


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


_CACHE: dict[str, object] = {}


def _compiled(template: str):
    if template not in _CACHE:
        _CACHE[template] = _environment().from_string(template)
    return _CACHE[template]


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # Only calling and fromkeys: no attribute access to break out of the sandbox with.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # No underscore attributes on a namespace: they lead to the interpreter's internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env
