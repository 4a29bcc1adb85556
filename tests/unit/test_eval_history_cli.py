"""`layerbus eval history SUITE` on runs recorded straight into a SQLite store: every run in order with its values,
the wide table or one block per task, --metric, --limit, --json, the empty history, and that it stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest

from layerbus.cli.main import main
from layerbus.storage import JobStore
from tests.helpers.cli import REPO
from tests.helpers.eval_runs import T0, flipped, mc_task, nightly, record_run, rolling_row

BASE = [True] * 60 + [False] * 40
METRICS = {"mc": ["acc", "acc_norm"], "corpus": ["bits_per_byte"]}


def night(outcomes, ll_shift=0.0):
    return mc_task("mc", outcomes) + [rolling_row("corpus", f"d{i}", -60.0 - i + ll_shift) for i in range(10)]


@pytest.fixture
def store_url(tmp_path):
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def runs(tmp_path, store_url):
    with JobStore.open(store_url) as store:
        recorded = nightly(store, tmp_path, [night(BASE), night(flipped(BASE, gain=range(60, 65))),
                                             night(flipped(BASE, lose=range(30)), ll_shift=-5.0)], METRICS)
        # Another suite's run and an unfinished nightly one: neither is nightly's history.
        record_run(store, tmp_path, night(BASE), METRICS, "weekly", T0 + timedelta(days=1, hours=1))
        record_run(store, tmp_path, night(BASE), METRICS, created_at=T0 + timedelta(days=9), finish=False)
    return recorded


def history(capsys, store_url, *args, columns=200, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("COLUMNS", str(columns))
    code = main(["eval", "history", *args, "--db", store_url])
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    return out


def test_each_run_in_order_with_its_values(runs, store_url, capsys, monkeypatch):
    out = history(capsys, store_url, "nightly", monkeypatch=monkeypatch)

    lines = out.splitlines()
    run_lines = [line for line in lines if line.startswith("2030-")]
    assert [line.split()[2] for line in run_lines] == [r.job_id for r in runs], "oldest first, nightly only"
    assert [line.split()[:2] for line in run_lines] == [["2030-01-02", "03:04"], ["2030-01-03", "03:04"],
                                                        ["2030-01-04", "03:04"]]
    # acc 0.60 -> 0.65 -> 0.30; the last drop is beyond 1.96 combined standard errors.
    assert "0.6000 ± 0.0492" in run_lines[0] and "0.6500 ± 0.0479 ↑" in run_lines[1]
    assert "0.3000 ± 0.0461 ↓*" in run_lines[2]
    header = next(line for line in lines if line.startswith("date (UTC)"))
    assert header.split()[-3:] == ["acc", "acc_norm", "bits_per_byte"]
    assert lines[lines.index(header) - 1].split() == ["mc", "corpus"], "task names over their columns, suite order"
    bpb = [runs[0].metrics[2].value, runs[2].metrics[2].value]
    assert f"{bpb[0]:.4f} ± 0.0100" in run_lines[0] and f"{bpb[1]:.4f} ± 0.0100 ↑*" in run_lines[2]
    trend = next(line for line in lines if line.startswith("trend")).split()
    assert trend == ["trend", "▇█▁", "▇█▁", "▁▁█"]
    assert out.rstrip().endswith(f"layerbus eval compare {runs[1].job_id} {runs[2].job_id}")


def test_a_narrow_terminal_gets_one_block_per_task(runs, store_url, capsys, monkeypatch):
    out = history(capsys, store_url, "nightly", monkeypatch=monkeypatch, columns=90)
    lines = out.splitlines()
    assert "mc" in lines and "corpus" in lines
    mc_block = lines[lines.index("mc") + 1:lines.index("corpus")]
    assert mc_block[0].split() == ["date", "(UTC)", "job", "fingerprint", "acc", "acc_norm"]
    assert sum(1 for line in mc_block if line.startswith("2030-")) == 3
    assert all(len(line) <= 90 for line in lines if line.startswith("2030-"))


def test_metric_and_limit_narrow_the_table(runs, store_url, capsys, monkeypatch):
    out = history(capsys, store_url, "nightly", "--metric", "acc", "--limit", "2", monkeypatch=monkeypatch)
    run_lines = [line for line in out.splitlines() if line.startswith("2030-")]
    assert [line.split()[2] for line in run_lines] == [runs[1].job_id, runs[2].job_id]
    assert "acc_norm" not in out and "bits_per_byte" not in out
    assert "0.6500 ± 0.0479" in run_lines[0] and "↑" not in run_lines[0], "the first run shown has no arrow"


def test_json_lists_every_run_and_metric(runs, store_url, capsys):
    found = json.loads(history(capsys, store_url, "nightly", "--json"))
    assert [r["job_id"] for r in found] == [r.job_id for r in runs]
    assert found[0]["created_at"] == "2030-01-02T03:04:05+00:00"
    assert [(m["task"], m["metric"], m["value"], m["n"]) for m in found[2]["metrics"]] == [
        ("corpus", "bits_per_byte", pytest.approx(runs[2].metrics[2].value), 10),
        ("mc", "acc", pytest.approx(0.30), 100), ("mc", "acc_norm", pytest.approx(0.30), 100)]


def test_a_changed_fingerprint_is_marked_and_explained(tmp_path, store_url, capsys, monkeypatch):
    with JobStore.open(store_url) as store:
        first = record_run(store, tmp_path, night(BASE), METRICS)
        second = record_run(store, tmp_path, night(BASE), METRICS, created_at=T0 + timedelta(days=1), wire="int8")
        hashes = [store.eval_run(r.job_id).fingerprint_hash[:8] for r in (first, second)]
    out = history(capsys, store_url, "nightly", monkeypatch=monkeypatch)
    run_lines = [line.split() for line in out.splitlines() if line.startswith("2030-")]
    assert hashes[0] != hashes[1]
    assert run_lines[0][2:5] == [first.job_id, hashes[0], "0.6000"]
    assert run_lines[1][2:5] == [second.job_id, hashes[1], "≠"]
    assert ("≠ fingerprint changed:\n"
            f"  2030-01-03 03:04  {second.job_id}: settings (wire: \"float32\" -> \"int8\")") in out


def test_empty_history_says_how_to_make_one(tmp_path, store_url, capsys):
    missing = f"sqlite:///{tmp_path / 'never-made.db'}"
    out = history(capsys, missing, "nightly")
    assert out == (f"no finished runs of suite 'nightly' in {missing} yet: `layerbus eval run --suite nightly` "
                   "records one; run it every night and this shows the trend\n")
    assert not (tmp_path / "never-made.db").exists(), "a read-only command creates no store"
    assert history(capsys, missing, "nightly", "--json") == "[]\n"


def test_an_unknown_metric_says_to_drop_it(runs, store_url, capsys):
    out = history(capsys, store_url, "nightly", "--metric", "f1")
    assert out == "no metric 'f1' in the 3 run(s) of suite 'nightly': drop --metric to see every metric\n"


def test_history_stays_light(runs, store_url):
    """Like `layerbus status`: no torch, transformers, pyarrow or SQLAlchemy on a SQLite store."""
    code = ("import json, sys; from layerbus.cli.main import main; "
            f"main(['eval', 'history', 'nightly', '--db', {store_url!r}]); "
            "print(json.dumps([m for m in ('torch', 'transformers', 'pyarrow', 'sqlalchemy', 'zmq') "
            "if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert runs[2].job_id in result.stdout
    assert json.loads(result.stdout.splitlines()[-1]) == []
