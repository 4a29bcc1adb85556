"""`layerbus eval compare` end to end on real runs of the default model: two runs of the same model
report no regression; a run of a deliberately damaged copy (noise on every decoder weight) reports
one, and `--fail-on-regression` exits 3. The task is the benchmark's cloze questions, which the
default model gets mostly right, so the damage shows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.bench_eval import cloze_questions
from tests.helpers.cli import layerbus, write_jsonl

pytestmark = pytest.mark.slow


def damaged_copy(model_dir: Path, out: Path) -> Path:
    """The model with Gaussian noise (half of each matrix's own spread) on every decoder-layer weight."""
    shutil.copytree(model_dir, out)
    generator = torch.Generator().manual_seed(0)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if ".layers." in name and tensor.dim() == 2:
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensors[name] = (tensor.float() + noise * tensor.float().std() * 0.5).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def test_compare_finds_no_regression_between_equal_models_and_one_after_damage(default_model, tmp_path):
    task = write_jsonl(tmp_path / "cloze.jsonl", cloze_questions(40, seed=7))
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'store.db'}"
    suite = tmp_path / "cloze-suite.toml"
    suite.write_text(f'name = "cloze"\n[[tasks]]\nname = "cloze"\npath = "{task}"\nmetrics = ["acc", "acc_norm"]\n')

    def run(model: Path) -> dict:
        # One stage holds the whole model whatever the partition: "equal" skips profiling it (about 15 s a model).
        result = layerbus(home, "eval", "run", "--suite", suite, "--model", model, "--db", db, "--partition", "equal",
                          "--json", timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    first, second = run(default_model), run(default_model)
    same = layerbus(home, "eval", "compare", first["job_id"], second["job_id"], "--db", db, "--fail-on-regression")
    assert same.returncode == 0, same.stdout + same.stderr

    damaged = run(damaged_copy(default_model, tmp_path / "damaged"))
    acc = {m["metric"]: m["value"] for m in damaged["metrics"]}
    base_acc = {m["metric"]: m["value"] for m in first["metrics"]}
    assert acc["acc"] < base_acc["acc"] - 0.2, (acc, base_acc)
    # BASE defaults to the suite's run before the candidate: the second undamaged run.
    worse = layerbus(home, "eval", "compare", "--db", db, "--fail-on-regression")
    assert worse.returncode == 3, worse.stdout + worse.stderr
    assert "worse" in worse.stdout
    assert layerbus(home, "eval", "compare", "--db", db).returncode == 0, "without the flag a regression is reported only"
