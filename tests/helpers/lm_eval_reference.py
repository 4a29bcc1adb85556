"""lm-evaluation-harness's own HF backend on a local model directory: the reference `layerbus eval` must equal.

Every helper runs lm-eval 0.4.x unchanged (`lm_eval.models.huggingface.HFLM`, `lm_eval.simple_evaluate`) in
float32 on the CPU, offline: while a helper runs, the Hugging Face Hub and datasets libraries are switched to
offline mode (module constants and environment, restored afterwards, so nothing leaks into other tests), and
datasets' cache goes to a temporary folder unless a task names its own `cache_dir`.

lm-eval is in the optional `test` extra: import this module only from tests that first call
`pytest.importorskip("lm_eval")`.

How lm-eval behaves here (0.4.13, transformers 5):
- max_length: when not given, HFLM takes the config's max_position_embeddings (256 for the tiny models, 8192 for
  SmolLM2-135M), not 2048. Every helper here therefore asks for max_length explicitly.
- loglikelihood scores (context + continuation)[-(max_length + 1):][:-1] in one forward pass; requests are
  sorted longest first and right-padded into batches of batch_size. With the logits cache (on by default),
  requests whose context + continuation[:-1] are equal share one forward pass (one-token continuations of one
  context), so the number of forward passes is not the number of requests.
- generate_until left-pads a batch, truncates each context on the left to max_length - max_gen_toks tokens
  (max_gen_toks must be below max_length: the default 256 fails on the tiny models), always adds the EOS text
  to `until`, decodes with skip_special_tokens=True and cuts the text at the first stop string.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub.constants
import torch
from lm_eval import evaluator
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

# A local multiple-choice task as lm-eval reads it, its documents in sums.jsonl beside the YAML.
MC_YAML = """\
task: tiny_sums
output_type: multiple_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: sums.jsonl
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""

OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextmanager
def offline(datasets_cache: Path | None = None) -> Iterator[None]:
    """Hub and datasets offline (and datasets' cache at `datasets_cache` if given) inside the block only.

    huggingface_hub and datasets read their offline switches from module constants set at import, which
    happened long before this module (transformers is imported by the test fixtures), so the constants are
    patched along with the environment.
    """
    saved_env = {name: os.environ.get(name) for name in OFFLINE_ENV}
    patches: list[tuple[object, str, Any]] = [
        (huggingface_hub.constants, "HF_HUB_OFFLINE", True),
        (datasets.config, "HF_HUB_OFFLINE", True),
        (datasets.config, "HF_DATASETS_OFFLINE", True),
    ]
    if datasets_cache is not None:
        patches.append((datasets.config, "HF_DATASETS_CACHE", Path(datasets_cache)))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    os.environ.update(dict.fromkeys(OFFLINE_ENV, "1"))
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """contextlib.chdir (Python 3.11+) for 3.10."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def hf_model_args(model_dir: Path | str, max_length: int) -> dict[str, Any]:
    """HFLM's arguments for a local model directory in float32 (simple_evaluate's model_args; device apart)."""
    return {"pretrained": str(Path(model_dir).resolve()), "dtype": "float32", "max_length": int(max_length)}


@lru_cache(maxsize=8)
def _cached_hf_lm(model_dir: str, max_length: int, batch_size: int | str) -> HFLM:
    with offline():
        return HFLM(**hf_model_args(model_dir, max_length), device="cpu", batch_size=batch_size)


def hf_lm(model_dir: Path | str, max_length: int, batch_size: int | str = 1) -> HFLM:
    """lm-eval's HF backend on `model_dir` (float32, CPU), one per (directory, max_length, batch_size).

    Shared between tests: treat it as read-only (its only state between calls is the auto batch size).
    """
    return _cached_hf_lm(str(Path(model_dir).resolve()), int(max_length), batch_size)


def hf_loglikelihood(lm: HFLM, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(log-likelihood, is_greedy) of each (context, continuation), as lm-eval's loglikelihood requests."""
    requests = [Instance("loglikelihood", {}, (context, continuation), i)
                for i, (context, continuation) in enumerate(pairs)]
    with offline(), torch.no_grad():
        return [(float(ll), bool(greedy)) for ll, greedy in lm.loglikelihood(requests, disable_tqdm=True)]


def hf_loglikelihood_rolling(lm: HFLM, texts: Sequence[str]) -> list[float]:
    """Each text's total log-likelihood over lm-eval's disjoint rolling windows of lm.max_length tokens."""
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    with offline(), torch.no_grad():
        return [float(ll) for ll in lm.loglikelihood_rolling(requests, disable_tqdm=True)]


def hf_generate_until(lm: HFLM, contexts_with_kwargs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """lm-eval's generate_until on (context, generation kwargs) pairs: greedy unless the kwargs say otherwise.

    The kwargs are lm-eval's: `until` (a string or list; EOS is always added), `max_gen_toks` (default 256,
    which must be below lm.max_length), `do_sample`, `temperature`, ...
    """
    requests = [Instance("generate_until", {}, (context, dict(kwargs)), i)
                for i, (context, kwargs) in enumerate(contexts_with_kwargs)]
    with offline(), torch.no_grad():
        return list(lm.generate_until(requests, disable_tqdm=True))


def task_names(task_yaml: Path) -> list[str]:
    """The task a YAML file defines, or every task in the YAML files of a folder (groups and tags left out)."""
    task_yaml = Path(task_yaml)
    if task_yaml.is_file():
        return [load_yaml(task_yaml, resolve_func=False)["task"]]
    return TaskManager(include_path=str(task_yaml), include_defaults=False).all_subtasks


def hf_simple_evaluate(
    model_dir: Path | str,
    task_yaml: Path | str,
    *,
    tasks: Sequence[str] | None = None,
    max_length: int,
    batch_size: int | str = 1,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    bootstrap_iters: int = 100000,
    log_samples: bool = False,
    datasets_cache: Path | None = None,
    **simple_evaluate_kwargs: Any,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate(model="hf") on local task YAML: its results dict ("results", "n-samples", ...).

    task_yaml is one task YAML file (its task is run) or a folder of them (`tasks`, or all of its tasks). The
    folder is lm-eval's include_path, without lm-eval's bundled tasks; lm-eval runs from that folder, so
    relative `data_files` resolve against it. datasets' cache goes to `datasets_cache` (a temporary folder,
    removed afterwards, when None) unless the YAML's dataset_kwargs name a cache_dir.
    """
    task_yaml = Path(task_yaml).resolve()
    folder = task_yaml if task_yaml.is_dir() else task_yaml.parent
    names = list(tasks) if tasks is not None else task_names(task_yaml)
    with tempfile.TemporaryDirectory(prefix="lm-eval-datasets-") as scratch, \
            offline(Path(datasets_cache) if datasets_cache is not None else Path(scratch)), \
            working_directory(folder):
        results = evaluator.simple_evaluate(
            model="hf",
            model_args=hf_model_args(model_dir, max_length),
            tasks=names,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            device="cpu",
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
            task_manager=TaskManager(include_path=str(folder), include_defaults=False),
            **simple_evaluate_kwargs,
        )
    if results is None:
        raise RuntimeError("lm_eval.simple_evaluate returned None (not rank 0?)")
    return results
