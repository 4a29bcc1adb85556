"""The `layerbus` console script without a cluster: submit, status, results, cancel from separate processes
against one store, and every user error as one message with exit 2 and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.cli import JOB_ID, REPO, layerbus, status_json, write_jsonl
from tests.helpers.fixtures_cli import home, tiny  # noqa: F401 - fixtures

DOCS = [{"id": f"doc-{i}", "text": f"The broker keeps a queue of jobs, number {i}."} for i in range(3)]


def test_submit_and_status_from_separate_processes_share_the_default_store(home, tmp_path, tiny):
    corpus = write_jsonl(tmp_path / "docs.jsonl", DOCS)

    submitted = layerbus(home, "submit", corpus, "--task", "summarize", "--model", tiny, "--name", "nightly")

    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert JOB_ID.fullmatch(job_id), f"stdout holds just the job id, got {submitted.stdout!r}"
    assert (home / "layerbus.db").is_file(), "the default store lives under LAYERBUS_HOME"
    status = status_json(home, job_id)
    assert (status["id"], status["status"], status["name"]) == (job_id, "queued", "nightly")
    assert status["request_counts"] == {"total": 3, "completed": 0, "failed": 0, "cancelled": 0, "queued": 3,
                                        "in_progress": 0}
    assert status["timestamps"]["created_at"].endswith("+00:00") and status["results_path"] is None
    table = layerbus(home, "status")
    assert table.returncode == 0 and job_id in table.stdout and "nightly" in table.stdout
    report = layerbus(home, "status", job_id)
    assert "3 total" in report.stdout and "queued" in report.stdout

    no_results = layerbus(home, "results", job_id)
    assert no_results.returncode == 1 and "no results file yet" in no_results.stderr

    cancelled = layerbus(home, "cancel", job_id)
    assert (cancelled.returncode, cancelled.stdout.strip()) == (0, "cancelled")
    assert status_json(home, job_id)["request_counts"]["cancelled"] == 3
    again = layerbus(home, "cancel", job_id)
    assert (again.returncode, again.stdout.strip()) == (0, "cancelled"), "cancelling twice is harmless"


def test_bad_input_is_refused_with_every_line_and_nothing_queued(home, tmp_path, tiny):
    corpus = write_jsonl(tmp_path / "mixed.jsonl", [DOCS[0], "{not json", DOCS[1], {"id": "no-text"}, DOCS[2]])

    refused = layerbus(home, "submit", corpus, "--task", "summarize", "--model", tiny)

    assert refused.returncode == 2
    assert f"{corpus}:2:" in refused.stderr and f"{corpus}:4:" in refused.stderr
    assert "--skip-invalid" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stdout == ""
    assert status_json(home) == [], "nothing was queued"

    skipped = layerbus(home, "submit", corpus, "--task", "summarize", "--model", tiny, "--skip-invalid")

    assert skipped.returncode == 0, skipped.stderr
    counts = status_json(home, skipped.stdout.strip())["request_counts"]
    assert (counts["total"], counts["queued"], counts["failed"]) == (5, 3, 2)


def _batch_line(custom_id: str, model: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "Say hi."}]}}


def test_a_line_naming_another_model_is_refused_with_its_line(home, tmp_path, tiny):
    # The job's model answers to its path and its directory's name; a line naming another model is
    # refused (answering it would give it another model's output), all lines reported at once.
    corpus = write_jsonl(tmp_path / "batch.jsonl", [_batch_line("a", str(tiny)), _batch_line("b", "NonExistModel"),
                                                    _batch_line("c", tiny.name)])

    refused = layerbus(home, "submit", corpus, "--task", "generate", "--model", tiny)

    assert refused.returncode == 2, refused.stderr
    assert f"{corpus}:2: body.model 'NonExistModel' is not this job's model ({tiny.name}" in refused.stderr
    assert f"{corpus}:1:" not in refused.stderr and f"{corpus}:3:" not in refused.stderr
    assert status_json(home) == [], "nothing was queued"

    skipped = layerbus(home, "submit", corpus, "--task", "generate", "--model", tiny, "--skip-invalid")

    assert skipped.returncode == 0, skipped.stderr
    counts = status_json(home, skipped.stdout.strip())["request_counts"]
    assert (counts["total"], counts["queued"], counts["failed"]) == (3, 2, 1)


def test_without_model_the_model_every_line_names_is_used(home, tmp_path, tiny):
    named = write_jsonl(tmp_path / "named.jsonl", [_batch_line("a", str(tiny)), _batch_line("b", str(tiny))])

    submitted = layerbus(home, "submit", named, "--task", "generate")

    assert submitted.returncode == 0, submitted.stderr
    assert status_json(home, submitted.stdout.strip())["model"] == str(tiny)

    unknown = write_jsonl(tmp_path / "unknown.jsonl", [_batch_line("a", "gpt-4o-mini")])
    refused = layerbus(home, "submit", unknown, "--task", "generate")
    assert refused.returncode == 2 and "'gpt-4o-mini', which is neither a model directory" in refused.stderr
    assert "--model DIR" in refused.stderr


def test_user_errors_name_the_problem_and_exit_2(home, tmp_path, tiny):
    corpus = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cases = [
        (["submit", tmp_path / "missing.jsonl", "--task", "summarize", "--model", tiny], "missing.jsonl"),
        (["submit", corpus, "--task", "translate", "--model", tiny], "--target-language"),
        (["submit", corpus, "--model", tiny], "--task"),
        (["submit", corpus, "--task", "summarize", "--model", tmp_path / "no-model"], "no-model"),
        (["status", "--db", "mysql://user@host/db"], "SQLite or PostgreSQL"),
        (["status", "job_000000000000"], "job_000000000000"),
        (["results", "job_000000000000"], "job_000000000000"),
        (["cancel", "job_000000000000"], "job_000000000000"),
        (["run", corpus, "--task", "summarize", "--model", tiny, "--stages", "9"], "--stages 4 or fewer"),
        (["run", "--job", "job_000000000000"], "job_000000000000"),
        (["run"], "--job"),
        (["model", "import-gguf", tmp_path / "missing.gguf", "--out", tmp_path / "imported"], "missing.gguf"),
    ]
    for args, named in cases:
        result = layerbus(home, *args)
        where = f"layerbus {' '.join(map(str, args))}"
        assert result.returncode == 2, f"{where}: exit {result.returncode}\n{result.stderr}"
        assert named in result.stderr, f"{where}: {result.stderr}"
        assert "Traceback" not in result.stderr, f"{where}: {result.stderr}"
    assert status_json(home) == [], "no failed command queued a job"


def test_status_stays_light():
    """`layerbus status` is polled by scripts: it must not import torch or transformers."""
    code = ("import sys; from cli.main import main; main(['status', '--json']); "
            "heavy = [m for m in ('torch', 'transformers', 'zmq', 'pyarrow') if m in sys.modules]; "
            "print(json.dumps(heavy))")
    result = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True,
                            cwd=REPO, env={"LAYERBUS_HOME": str(REPO / ".pytest_cache" / "light-home"),
                                           "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_help_lists_every_subcommand(home):
    result = layerbus(home, "--help")
    for command in ("submit", "run", "status", "results", "cancel", "broker", "stage", "model", "keys"):
        assert command in result.stdout
    stage_help = layerbus(home, "stage", "--help")
    assert stage_help.returncode == 0 and "--broker" in stage_help.stdout


def test_keys_new_writes_a_pair_once(home, tmp_path):
    made = layerbus(home, "keys", "new", tmp_path / "keys", "--name", "broker")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(tmp_path / "keys" / "broker.key")
    assert (tmp_path / "keys" / "broker.key_secret").stat().st_mode & 0o077 == 0
    again = layerbus(home, "keys", "new", tmp_path / "keys", "--name", "broker")
    assert again.returncode == 2 and "never overwritten" in again.stderr and "Traceback" not in again.stderr
