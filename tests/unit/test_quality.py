"""`layerbus quality`: every weight format x wire codec pair against float32 weights on the float32 wire."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from layerbus.cli.main import main
from layerbus.jobs.corpus import corpus_prompts
from layerbus.models.model_info import load_tokenizer
from layerbus.stages.quality import measure_quality

REPO = Path(__file__).resolve().parents[2]


def test_the_reference_pair_is_exact_and_quantizing_costs_something(tiny_models, tmp_path):
    model_dir = tiny_models("llama", num_hidden_layers=4)
    (tmp_path / "a.txt").write_text("The stage receives a batch of hidden states, runs its layers, and sends them on.")
    (tmp_path / "b.txt").write_text("The broker keeps a queue of jobs. A worker claims a job and reports progress.")
    prompts = corpus_prompts(load_tokenizer(model_dir), tmp_path)
    pairs = {(p.weights, p.codec): p for p in measure_quality(model_dir, prompts, [2], ("fp32", "bf16", "int8", "int4"),
                                                               ("float32", "int4"))}
    assert len(pairs) == 8
    reference = pairs["fp32", "float32"]
    assert reference.positions == sum(len(p) - 1 for p in prompts)
    assert reference.mean_kl == 0 and reference.same_top == 1 and reference.top5 == 1 and reference.ppl_change == 0
    for key in (("int4", "float32"), ("int8", "float32"), ("bf16", "float32"), ("fp32", "int4")):
        assert pairs[key].mean_kl > 0, key
    # 4 bits cost more than 8 on the same wire, and more with a 4-bit wire on top
    assert pairs["int4", "float32"].mean_kl > pairs["int8", "float32"].mean_kl
    assert pairs["int4", "int4"].mean_kl > pairs["int4", "float32"].mean_kl
    assert all(0 <= p.top5 <= 1 and 0 <= p.same_top <= 1 for p in pairs.values())


def test_quality_command_prints_json_and_a_table(tiny_models, tmp_path, capsys):
    model_dir = tiny_models("llama", num_hidden_layers=4)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A model that is too large for one device can still be served.\n\nWhen its layers are split.")
    assert main(["quality", str(corpus), "--model", str(model_dir), "--weights", "int8,int4", "--wire", "float32",
                 "--stages", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["weights"], p["wire"]) for p in report["pairs"]] == [("int8", "float32"), ("int4", "float32")]
    assert report["reference"] == {"weights": "fp32", "wire": "float32"} and report["cuts"] == [2]
    assert main(["quality", str(corpus), "--model", str(model_dir), "--weights", "int4", "--wire", "int8"]) == 0
    assert "| int4 | int8 |" in capsys.readouterr().out


@pytest.mark.parametrize("args, named", [
    (["--weights", "int3"], "int3"),
    (["--wire", "float8"], "float8"),
    (["--cuts", "9"], "--cuts"),
])
def test_bad_choices_name_the_way_out(tiny_models, capsys, args, named):
    model_dir = tiny_models("llama", num_hidden_layers=4)
    assert main(["quality", "--model", str(model_dir), *args]) == 2
    assert named in capsys.readouterr().err


def test_help_does_not_import_torch():
    code = ("import sys; from cli.main import main\ntry:\n    main(['quality', '--help'])\nexcept SystemExit:\n    pass\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
