"""`layerbus eval compare` on runs recorded straight into a SQLite store (tests/helpers/eval_runs.py): the
verdicts, the exit codes, the refusals and the defaults, in-process through cli.main.main
(tests/cluster/test_eval_compare_cli.py runs the console script for exit code 3, as CI would)."""

from __future__ import annotations

import json
import math
from datetime import timedelta

import pytest

from layerbus.cli.main import main
from layerbus.evals.compare import mcnemar
from tests.helpers.eval_runs import ACC_ONLY, BASE, T0, flipped, mc_row, mc_task, nightly, record_run, rolling_row
from tests.helpers.eval_runs import store, store_url  # noqa: F401 - fixtures


def run_cli(capsys, store_url, *args):
    """(exit code, stdout, stderr) of `layerbus eval compare ARGS --db URL`, in this process."""
    code = main(["eval", "compare", *args, "--db", store_url])
    out, err = capsys.readouterr()
    return code, out, err


def compare_json(capsys, store_url, *args):
    code, out, err = run_cli(capsys, store_url, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_a_run_against_itself_is_no_regression(tmp_path, store, store_url, capsys):
    (only,) = nightly(store, tmp_path, [mc_task("mc", BASE)], {"mc": ["acc", "acc_norm"]})

    code, out, err = run_cli(capsys, store_url, only.job_id, only.job_id, "--fail-on-regression")

    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[2] == "changed    nothing: same fingerprint"
    acc = next(line for line in lines if line.startswith("mc ") and " acc " in line).split()
    assert acc[:5] == ["mc", "acc", "0.6000", "0.6000", "+0.0000"]
    assert acc[-3:] == ["no", "significant", "change"]
    assert "result: no metric significantly worse (of 2, after Holm's correction); 0 better" in out
    assert "flipped documents" not in out and "left out" not in out


def test_ten_gained_two_lost_is_better_and_shown_with_margins(tmp_path, store, store_url, capsys):
    base, cand = nightly(store, tmp_path, [mc_task("mc", BASE), mc_task("mc", flipped(BASE, range(2), range(60, 70)))],
                         ACC_ONLY)

    code, out, _ = run_cli(capsys, store_url, base.job_id, cand.job_id, "--fail-on-regression")

    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("mc ")).split()
    # exact McNemar, Bin(12, 1/2): 2 * 79 / 4096 = 0.0386; the paired interval of the +0.08 difference.
    assert row == ["mc", "acc", "0.6000", "0.6800", "+0.0800", "[+0.0136,", "+0.1464]", "0.0386", "0.0386", "exact",
                   "100", "better"]
    assert "  mc acc: 10 gained, 2 lost" in out
    assert "    q000  lost    margin +1.000 -> -1.000" in out
    assert "... and 6 more" in out, "six of twelve flips in the table"
    assert "result: no metric significantly worse (of 1, after Holm's correction); 1 better" in out

    report = compare_json(capsys, store_url, base.job_id, cand.job_id)
    (metric,) = report["metrics"]
    assert (metric["gained"], metric["lost"], metric["verdict"], metric["test"]) == (10, 2, "better", "exact")
    assert metric["p"] == pytest.approx(2 * 79 / 4096)
    assert len(metric["flips"]) == 12, "every flip in --json"
    assert {f["doc_id"] for f in metric["flips"] if not f["gained"]} == {"q000", "q001"}
    assert report["regression"] is False and report["regressions"] == []


def test_many_documents_flipped_to_wrong_is_worse_and_exits_0_without_the_flag(tmp_path, store, store_url, capsys):
    base, cand = nightly(store, tmp_path, [mc_task("mc", BASE), mc_task("mc", flipped(BASE, range(30), [60, 61]))],
                         ACC_ONLY)

    code, out, _ = run_cli(capsys, store_url, base.job_id, cand.job_id)

    assert code == 0, "a verdict alone does not fail the command"
    row = next(line for line in out.splitlines() if line.startswith("mc ")).split()
    assert row[2:5] == ["0.6000", "0.3200", "-0.2800"] and row[-2:] == ["100", "worse"]
    assert row[7] == "<0.0001", "chi-squared (|30 - 2| - 1)^2 / 32 = 22.8: p = 1.8e-6"
    assert row[9] == "chi2", "32 discordant documents: the chi-squared test"
    assert "result: 1 of 1 metric(s) significantly worse after Holm's correction: mc acc; --fail-on-regression " \
           "would exit 3" in out
    report = compare_json(capsys, store_url, base.job_id, cand.job_id)
    assert report["regression"] is True
    assert report["regressions"] == [{"task": "mc", "metric": "acc", "filter": "none"}]
    assert report["metrics"][0]["p"] == pytest.approx(mcnemar(30, 2)[0])


def test_min_effect_spares_a_small_significant_regression(tmp_path, store, store_url, capsys):
    base, cand = nightly(store, tmp_path, [mc_task("mc", BASE), mc_task("mc", flipped(BASE, range(30), [60, 61]))],
                         ACC_ONLY)
    code, out, _ = run_cli(capsys, store_url, base.job_id, cand.job_id, "--fail-on-regression", "--min-effect", "0.3")
    assert code == 0
    assert "below min effect" in out and "at least 0.3 in size" in out


def test_differing_prompts_are_not_comparable(tmp_path, store, store_url, capsys):
    base_rows = mc_task("mc", BASE)
    cand_rows = [mc_row("mc", r["doc_id"], bool(r["acc"]), prompt_hash="changed") if i in (4, 8, 9) else r
                 for i, r in enumerate(base_rows)]
    base, cand = nightly(store, tmp_path, [base_rows, cand_rows], ACC_ONLY)

    code, out, err = run_cli(capsys, store_url, base.job_id, cand.job_id)

    assert (code, out) == (2, "")
    assert err.startswith(f"layerbus eval: error: not comparable: 3 prompts differ between {base.job_id} and "
                          f"{cand.job_id}: 3 changed (task 'mc': q004, q008, q009)")
    assert err.endswith("their fingerprints).\n"), "same fingerprint: nothing more to say"
    assert "Traceback" not in err


def test_a_document_missing_from_one_run_is_not_comparable(tmp_path, store, store_url, capsys):
    base, cand = nightly(store, tmp_path, [mc_task("mc", BASE), mc_task("mc", BASE[:98])], ACC_ONLY)
    code, _, err = run_cli(capsys, store_url, base.job_id, cand.job_id)
    assert code == 2
    assert f"not comparable: 2 prompts differ between {base.job_id} and {cand.job_id}: 2 only in {base.job_id} " \
           "(task 'mc': q098, q099)" in err


def test_not_comparable_says_what_the_fingerprints_differ_in(tmp_path, store, store_url, capsys):
    base = record_run(store, tmp_path, mc_task("mc", BASE), ACC_ONLY)
    cand = record_run(store, tmp_path, mc_task("mc", BASE[:98]), ACC_ONLY, created_at=T0 + timedelta(days=1), limit=98)
    code, _, err = run_cli(capsys, store_url, base.job_id, cand.job_id)
    assert code == 2
    assert err.endswith("their fingerprints). Their fingerprints differ in: settings (limit: null -> 98).\n")


def test_defaults_compare_the_latest_run_with_the_one_before_it(tmp_path, store, store_url, capsys):
    first, second, third = nightly(store, tmp_path, [mc_task("mc", BASE)] * 3, ACC_ONLY)
    # A later run of another suite, and a later nightly run that never finished: neither is a default.
    other = record_run(store, tmp_path, [rolling_row("corpus", "a", -5.0)], {"corpus": ["bits_per_byte"]}, "weekly",
                       T0 + timedelta(days=5))
    record_run(store, tmp_path, mc_task("mc", BASE), ACC_ONLY, created_at=T0 + timedelta(days=6), finish=False)

    report = compare_json(capsys, store_url, "--suite", "nightly")
    assert (report["base"]["job_id"], report["candidate"]["job_id"]) == (second.job_id, third.job_id)
    # Without --suite the candidate is the latest finished run of any suite, here the weekly one: no earlier weekly.
    code, _, err = run_cli(capsys, store_url)
    assert code == 2
    assert err == (f"layerbus eval: error: no earlier run of suite 'weekly' before {other.job_id}: run `layerbus eval "
                   "run --suite weekly` again tomorrow, or name BASE\n")
    # BASE alone: the candidate is the latest run of BASE's suite.
    report = compare_json(capsys, store_url, first.job_id)
    assert (report["base"]["job_id"], report["candidate"]["job_id"]) == (first.job_id, third.job_id)
    code, _, err = run_cli(capsys, store_url, third.job_id)
    assert code == 2
    assert f"BASE {third.job_id} is itself the latest run of suite 'nightly': name an earlier BASE" in err


def test_the_first_run_of_a_suite_has_nothing_to_compare_with(tmp_path, store, store_url, capsys):
    (only,) = nightly(store, tmp_path, [mc_task("mc", BASE)], ACC_ONLY)
    code, _, err = run_cli(capsys, store_url, "--suite", "nightly")
    assert code == 2
    assert f"no earlier run of suite 'nightly' before {only.job_id}: run `layerbus eval run --suite nightly` again " \
           "tomorrow, or name BASE" in err
    code, _, err = run_cli(capsys, store_url, "--suite", "monthly")
    assert code == 2 and "no finished eval run of suite 'monthly' in sqlite:///" in err


def test_an_unfinished_or_missing_run_is_named(tmp_path, store, store_url, capsys):
    (done,) = nightly(store, tmp_path, [mc_task("mc", BASE)], ACC_ONLY)
    running = record_run(store, tmp_path, mc_task("mc", BASE), ACC_ONLY, finish=False)
    code, _, err = run_cli(capsys, store_url, done.job_id, running.job_id)
    assert code == 2
    assert f"eval run {running.job_id} has not finished (no samples file yet): `layerbus eval run --job " \
           f"{running.job_id}` finishes it" in err
    code, _, err = run_cli(capsys, store_url, done.job_id, "job_000000000000")
    assert code == 2 and "no eval run job_000000000000" in err
    done.samples_path.unlink()
    code, _, err = run_cli(capsys, store_url, done.job_id, done.job_id)
    assert code == 2 and f"the samples file of eval run {done.job_id} is missing: {done.samples_path}" in err


def test_the_fingerprint_parts_that_changed_are_printed(tmp_path, store, store_url, capsys):
    base = record_run(store, tmp_path, mc_task("mc", BASE), ACC_ONLY)
    model = {"config": "c" * 64, "weights": {"model.safetensors": "v" * 64}, "tokenizer": "t" * 64,
             "chat_template": None}
    cand = record_run(store, tmp_path, mc_task("mc", BASE), ACC_ONLY, created_at=T0 + timedelta(days=1),
                      model=model, wire="int8")

    code, out, _ = run_cli(capsys, store_url, base.job_id, cand.job_id)

    assert code == 0
    assert 'changed    model weights (model.safetensors); settings (wire: "float32" -> "int8")' in out.splitlines()
    report = compare_json(capsys, store_url, base.job_id, cand.job_id)
    assert [(c["part"], c["path"]) for c in report["fingerprint_changes"]] == [
        ("model weights", "model.weights.model.safetensors"), ("settings", "wire")]


def test_bits_per_byte_is_compared_by_paired_bootstrap(tmp_path, store, store_url, capsys):
    lls = [-60.0 - (i % 7) * 3.0 for i in range(30)]
    corpus = {"corpus": ["bits_per_byte"]}
    base, cand = nightly(store, tmp_path, [[rolling_row("corpus", f"d{i}", ll) for i, ll in enumerate(lls)],
                                           [rolling_row("corpus", f"d{i}", ll - 2.0) for i, ll in enumerate(lls)]],
                         corpus)

    report = compare_json(capsys, store_url, base.job_id, cand.job_id, "--bootstrap-iters", "2000")

    (metric,) = report["metrics"]
    assert (metric["test"], metric["higher_is_better"], metric["verdict"]) == ("bootstrap", False, "worse")
    assert metric["base"] == pytest.approx(-sum(lls) / 3000 / math.log(2))
    assert metric["base"] == pytest.approx(base.metrics[0].value), "the same value finalize recorded"
    assert metric["diff"] == pytest.approx(2.0 / 100 / math.log(2))
    assert metric["flips"] == [] and metric["n"] == 30


def test_failed_documents_are_excluded_and_said_so(tmp_path, store, store_url, capsys):
    outcomes = [True] * 10 + [False] * 10
    failing = [None if i in (2, 12) else ok for i, ok in enumerate(outcomes)]
    base, cand = nightly(store, tmp_path, [mc_task("mc", outcomes), mc_task("mc", failing)], ACC_ONLY)

    code, out, _ = run_cli(capsys, store_url, base.job_id, cand.job_id)

    assert code == 0
    assert "left out\n  mc acc: 2 failed document(s) left out of both runs (q002 in the candidate: the item failed: " \
           "stage lost three times; q012 in the candidate: the item failed: stage lost three times)" in out
    row = next(line for line in out.splitlines() if line.startswith("mc ")).split()
    assert row[2:4] == ["0.5000", "0.5000"] and row[10] == "18"


def test_usage_errors_exit_2(store_url, capsys):
    with pytest.raises(SystemExit) as usage:
        main(["eval", "compare", "--min-effect", "-1", "--db", store_url])
    assert usage.value.code == 2
    assert "must be a number >= 0" in capsys.readouterr().err


def test_a_near_tie_flip_is_flagged_with_its_unrounded_margin(tmp_path, store, store_url, capsys):
    base_rows = mc_task("mc", BASE)
    cand_rows = [mc_row("mc", "q000", False, margin=0.0004)] + mc_task("mc", BASE)[1:]
    base, cand = nightly(store, tmp_path, [base_rows, cand_rows], ACC_ONLY)
    code, out, _ = run_cli(capsys, store_url, base.job_id, cand.job_id)
    assert code == 0
    assert "    q000  lost    margin +1.000 -> -4.0e-04  ~ near tie" in out
    (flip,) = compare_json(capsys, store_url, base.job_id, cand.job_id)["metrics"][0]["flips"]
    assert flip == {"doc_id": "q000", "gained": False, "base_margin": 1.0, "candidate_margin": pytest.approx(-0.0004),
                    "near_tie": True}
