"""`layerbus eval compare --fail-on-regression` run as CI runs it, the console script in a subprocess, on runs
recorded straight into a SQLite store (tests/helpers/eval_runs.py): a regression exits 3."""

from __future__ import annotations

from tests.helpers.cli import layerbus
from tests.helpers.eval_runs import ACC_ONLY, BASE, flipped, mc_task, nightly
from tests.helpers.eval_runs import store, store_url  # noqa: F401 - fixtures


def test_fail_on_regression_exits_3_from_the_console_script(tmp_path, store, store_url):
    base, cand = nightly(store, tmp_path, [mc_task("mc", BASE), mc_task("mc", flipped(BASE, range(30), [60, 61]))],
                         ACC_ONLY)

    gate = layerbus(tmp_path / "home", "eval", "compare", "--fail-on-regression", "--db", store_url)

    assert gate.returncode == 3, gate.stderr
    assert f"base       {base.job_id}" in gate.stdout and f"candidate  {cand.job_id}" in gate.stdout
    assert "mc acc; exit 3 (--fail-on-regression)" in gate.stdout
    assert gate.stderr == ""
