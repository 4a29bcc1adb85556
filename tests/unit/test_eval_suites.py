"""Suite files: the bundled suite loads through every reader, and each bad suite gets `file: message` naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerbus.evals.documents import MULTIPLE_CHOICE, ROLLING
from layerbus.evals.suites import MetricSpec, SuiteError, load_suite, load_suite_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NIGHTLY = EXAMPLES / "evals" / "nightly.toml"


def test_the_bundled_suite_loads_with_no_problems():
    suite = load_suite(NIGHTLY)
    tasks = {t.name: t for t in load_suite_tasks(suite)}
    assert (suite.name, suite.seed, list(tasks)) == ("nightly", 1234, ["everyday-mc", "units", "exact-answers",
                                                                       "corpus-bpb"])
    kinds = {t.kind for t in tasks.values()}
    assert kinds == {"multiple_choice", "generate_until", "loglikelihood_rolling"}
    assert tasks["exact-answers"].metrics == (MetricSpec("exact_match", {"regexes_to_ignore": ["^\\s+", "\\.$"]}),)
    assert len(tasks["exact-answers"].docs) >= 15


def test_the_multiple_choice_file_has_distinct_ids_and_one_gold_each():
    mc = {t.name: t for t in load_suite_tasks(load_suite(NIGHTLY))}["everyday-mc"]
    assert mc.kind == MULTIPLE_CHOICE and len(mc.docs) >= 50
    assert len({d.id for d in mc.docs}) == len(mc.docs)
    assert all(len(d.gold) == 1 and len(d.choices) == 4 for d in mc.docs)
    golds = [d.gold[0] for d in mc.docs]
    assert min(golds.count(i) for i in range(4)) >= len(golds) // 4 - 1  # the answer's position gives nothing away


def test_the_yaml_task_is_two_shot_with_the_suites_seed():
    units = {t.name: t for t in load_suite_tasks(load_suite(NIGHTLY))}["units"]
    assert (units.num_fewshot, units.fewshot_seed, units.config["fewshot_seed"]) == (2, 1234, 1234)
    assert all(d.context.startswith("Convert between units.\n\n") and d.context.count("Question:") == 3
               for d in units.docs)


def test_the_corpus_task_reads_the_sample_corpus_itself():
    corpus = {t.name: t for t in load_suite_tasks(load_suite(NIGHTLY))}["corpus-bpb"]
    files = sorted((EXAMPLES / "sample_corpus").glob("*.txt"))
    assert corpus.kind == ROLLING
    assert [(d.id, d.text) for d in corpus.docs] == [(f.stem, f.read_text().rstrip("\r\n")) for f in files]


def test_limit_applies_to_every_task():
    tasks = load_suite_tasks(load_suite(NIGHTLY), limit=3)
    assert [(len(t.docs), t.n_original) for t in tasks] == [(3, 62), (3, 12), (3, 20), (3, 40)]


GOOD_TASK = '[[tasks]]\nname = "t"\npath = "t.jsonl"\nmetrics = ["acc"]\n'


@pytest.mark.parametrize("text, message", [
    ('seed = 1\n' + GOOD_TASK, "name must be a string of letters"),
    ('name = "n"\nsed = 1\n' + GOOD_TASK, "unknown key 'sed' (did you mean 'seed'?)"),
    ('name = "n"\nseed = -1\n' + GOOD_TASK, "seed must be an integer >= 0, got -1"),
    ('name = "n"\n', "tasks: give at least one [[tasks]] table"),
    ('name = "n"\n' + GOOD_TASK.replace("metrics", "metric"), "tasks[1] ('t'): unknown key 'metric' (did you mean"),
    ('name = "n"\n' + GOOD_TASK.replace("t.jsonl", "nope.jsonl"), "tasks[1] ('t'): path 'nope.jsonl' does not exist"),
    ('name = "n"\n' + GOOD_TASK.replace('"acc"', '"accuracy"'), "unknown metric 'accuracy' (did you mean 'acc'?)"),
    ('name = "n"\n' + GOOD_TASK.replace('"acc"', '{metric = "acc", ignore_case = true}'),
     "acc has no option(s) ignore_case; accepted: none"),
    ('name = "n"\n' + GOOD_TASK * 2, "the name 't' is used twice"),
    ('name = "n"\n' + GOOD_TASK.replace('"acc"', '"bits_per_byte"'),
     "metrics bits_per_byte do not apply to multiple choice documents; use acc, acc_norm"),
    ('name = "n"\n' + GOOD_TASK + "num_fewshot = 2\n", "num_fewshot applies to task YAML only"),
    ('name = "n"\n[[tasks]\n', "not valid TOML"),
])
def test_each_bad_suite_gets_one_message_naming_the_field(tmp_path, text, message):
    (tmp_path / "t.jsonl").write_text('{"id": "a", "context": "c", "choices": [" x", " y"], "gold": 0}\n')
    path = tmp_path / "suite.toml"
    path.write_text(text)
    with pytest.raises(SuiteError) as caught:
        load_suite_tasks(load_suite(path))
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(f"{path}: "), caught.value.problems
    assert message in caught.value.problems[0]


def test_a_bad_task_in_a_suite_reports_its_file_and_line(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"id": "a", "context": "c", "choices": [" x", " y"], "gold": 5}\n')
    (tmp_path / "suite.toml").write_text('name = "n"\n' + GOOD_TASK)
    with pytest.raises(SuiteError, match=r"t.jsonl:1: gold 5 is out of range for 2 choices"):
        load_suite_tasks(load_suite(tmp_path / "suite.toml"))


def test_lm_eval_reads_the_bundled_task_yaml_into_the_same_requests(tmp_path, monkeypatch):
    """units.yaml is plain lm-eval YAML: run from its folder, lm-eval 0.4.13 builds the requests we build."""
    import yaml

    task_module = pytest.importorskip("lm_eval.api.task")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(NIGHTLY.parent)
    config = yaml.safe_load((NIGHTLY.parent / "units.yaml").read_text())
    config["dataset_kwargs"]["cache_dir"] = str(tmp_path / "hf")
    theirs = task_module.ConfigurableTask(config=config)
    theirs.set_fewshot_seed(1234)
    theirs.build_all_requests()
    units = {t.name: t for t in load_suite_tasks(load_suite(NIGHTLY))}["units"]
    ours = [(int(d.id), (d.context, d.target_delimiter + c)) for d in units.docs for c in d.choices]
    assert ours == [(i.doc_id, i.arguments) for i in theirs.instances]


def test_a_yaml_tasks_filters_and_metric_options_reach_the_loaded_task(tmp_path):
    """exact_match's options and filter_list change the scores, so the loaded task carries both."""
    (tmp_path / "q.jsonl").write_text('{"q": "2+2?", "a": "4"}\n')
    (tmp_path / "gen.yaml").write_text(
        "task: gen\noutput_type: generate_until\ndataset_path: json\ndata_files: {test: q.jsonl}\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: a\n"
        "metric_list:\n  - {metric: exact_match, ignore_case: true, aggregation: mean, higher_is_better: true}\n"
        "filter_list:\n  - name: strict\n    filter: [{function: regex, regex_pattern: '(\\d+)'}, {function: take_first}]\n"
        "  - name: loose\n    filter: [{function: lowercase}]\n")
    (tmp_path / "suite.toml").write_text('name = "n"\n[[tasks]]\nname = "gen"\npath = "gen.yaml"\n')
    (task,) = load_suite_tasks(load_suite(tmp_path / "suite.toml"))
    assert task.metrics == (MetricSpec("exact_match", {"ignore_case": True}),)
    assert list(task.filters) == ["strict", "loose"]
    assert [s.function for s in task.filters["strict"]] == ["regex", "take_first"]
    assert task.filters["strict"][0].regex_pattern == "(\\d+)"


def test_a_task_file_has_no_filters(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"id": "a", "context": "c", "choices": [" x", " y"], "gold": 0}\n')
    (tmp_path / "suite.toml").write_text('name = "n"\n' + GOOD_TASK)
    (task,) = load_suite_tasks(load_suite(tmp_path / "suite.toml"))
    assert task.filters == {}


def test_tasks_given_on_the_command_line_are_named_as_lm_eval_names_them(tmp_path):
    """A task YAML by its `task:` field, whatever its file is called; a task file by its stem; two of one name
    apart by a suffix."""
    from layerbus.evals.eval_run import EvalOptions, select_tasks

    (tmp_path / "q.jsonl").write_text('{"q": "2+2?", "a": "4"}\n')
    yaml_task = "output_type: generate_until\ndataset_path: json\ndata_files: {test: q.jsonl}\ndoc_to_text: '{{q}}'\n" \
                "doc_to_target: a\nmetric_list:\n  - {metric: exact_match}\n"
    (tmp_path / "shots.yaml").write_text("task: hidden_mc_shots\n" + yaml_task)
    (tmp_path / "unnamed.yaml").write_text(yaml_task)
    (tmp_path / "t.jsonl").write_text('{"id": "a", "context": "c", "choices": [" x", " y"], "gold": 0}\n')
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "t.jsonl").write_text('{"id": "a", "context": "c", "choices": [" x", " y"], "gold": 0}\n')
    given = [tmp_path / "shots.yaml", tmp_path / "unnamed.yaml", tmp_path / "t.jsonl", tmp_path / "other" / "t.jsonl"]
    suite, tasks = select_tasks(EvalOptions(task_paths=tuple(str(p) for p in given)))
    assert [t.name for t in suite.tasks] == ["hidden_mc_shots", "unnamed", "t", "t_"]
    assert [t.name for t in tasks] == ["hidden_mc_shots", "unnamed", "t", "t_"]
