"""Chat templates rendered without transformers (models.chat_template) must render exactly what
transformers' `apply_chat_template(..., tokenize=False)` renders, or step aside for it; and the
commands that compute nothing (`submit`, `status`, `results`, `cancel`) import no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerbus.models.chat_template import ChatTemplate, read_chat_template
from tests.helpers.chat_templates import assert_renders_like_transformers


# Plain and indented block tags on their own lines (trim_blocks, lstrip_blocks), namespace(), dict(),
# tojson on text with non-ASCII and HTML characters (Jinja's own tojson escapes them; transformers'
# does not) and raise_exception: the environment must behave as transformers' does.
RICH_TEMPLATE = """\
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
{{ bos_token }}{{ dict(role=message['role'], n=ns.count, content=message['content']) | tojson }}
{{ message['content'] }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


def _with_template(source: Path, target: Path, template) -> Path:
    """A copy of `source`'s tokenizer files whose tokenizer_config.json carries `template`."""
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return target


def test_tiny_model_template_renders_like_transformers(tiny_models) -> None:
    assert_renders_like_transformers(tiny_models("llama"))


def test_namespace_dict_tojson_and_raise_exception_behave_as_in_transformers(tiny_models, tmp_path) -> None:
    model = _with_template(tiny_models("llama"), tmp_path / "rich", RICH_TEMPLATE)
    assert_renders_like_transformers(model)
    with pytest.raises(Exception, match="unknown role tool"):
        read_chat_template(model).apply_chat_template([{"role": "tool", "content": "x"}])


def test_templates_it_cannot_render_go_to_transformers(tiny_models, tmp_path) -> None:
    tiny = tiny_models("llama")
    generation_tag = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert read_chat_template(_with_template(tiny, tmp_path / "tagged", generation_tag)) is None
    named = [{"name": "default", "template": "{{ messages[0]['content'] }}"}]
    assert read_chat_template(_with_template(tiny, tmp_path / "named", named)) is None
    assert read_chat_template(tmp_path) is None, "no tokenizer files: transformers names what is missing"
    plain = read_chat_template(_with_template(tiny, tmp_path / "plain", None))
    assert plain == ChatTemplate("") and not plain.chat_template, "no template: prompts take the plain form"


def test_commands_that_compute_nothing_import_no_torch(tiny_models, tmp_path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Document {i}."}) + "\n" for i in range(10)))
    db = f"sqlite:///{tmp_path / 'store.db'}"
    code = """
import json, sys
from layerbus.cli.main import main
args = json.loads(sys.argv[1])
try:
    main(args)
except SystemExit:
    pass
heavy = [m for m in ("torch", "transformers.modeling_utils") if m in sys.modules]
print("HEAVY " + json.dumps(heavy))
"""

    def run(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-c", code, json.dumps(list(args))], capture_output=True, text=True,
                                env={"LAYERBUS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}, timeout=120)
        heavy = json.loads(result.stdout.splitlines()[-1].removeprefix("HEAVY "))
        assert heavy == [], f"layerbus {' '.join(args)} imported {heavy}\n{result.stderr}"
        return result

    submitted = run("submit", str(corpus), "--task", "summarize", "--model", str(tiny_models("llama")), "--db", db)
    job_id = submitted.stdout.splitlines()[0].strip()
    assert job_id.startswith("job_"), submitted.stderr
    for args in (("status", "--db", db), ("status", job_id, "--db", db), ("results", job_id, "--db", db),
                 ("cancel", job_id, "--db", db)):
        run(*args)
