"""`n` samples per item through real stages: four distinct samples that a rerun and a kill -9 of the middle
stage leave unchanged; `layerbus run --n` writes every sample to the Parquet and n choices to the output file."""

from __future__ import annotations

import json
from pathlib import Path

from layerbus.jobs.item_params import item_params
from layerbus.storage import JobSettings, JobStore, NewItem
from layerbus.storage.results import read_results


def sampled_job(model_dir: Path, work: Path, kill_after: int | None) -> tuple[list[str], list[dict]]:
    """A job of 6 items, 4 samples each (the job's --n), plus an item of one sample with the same prompt and
    seed as the first, run by run_job over 3 real stages; the middle one killed after `kill_after` results."""
    from layerbus.broker.broker import BrokerConfig
    from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
    from layerbus.planner.placement import PlanOptions
    from layerbus.planner.batching import BatchingConfig
    from layerbus.jobs.runner import run_job
    from tests.helpers.faulted_runs import FAST_LIVENESS, KillAfter

    settings = JobSettings(task="generate", model=str(model_dir), max_new_tokens=12, temperature=1.0, seed=5,
                           extra={"n": 4})
    prompts = [f"The stage {word} a batch of rows" for word in ("reads", "sends", "holds", "drops", "keeps", "loads")]
    items = [NewItem(f"doc-{i}", prompt, prompt, item_params({"seed": 1000 + i}, add_special_tokens=True), seq=i)
             for i, prompt in enumerate(prompts)]
    items.append(NewItem("single", prompts[0], prompts[0], item_params({"seed": 1000, "n": 1}, True), seq=len(items)))
    config = BrokerConfig(str(model_dir), 3, batching=BatchingConfig(num_slots=8, num_micro_batches=4,
                                                                     max_step_tokens=32),
                          pipeline=FAST_LIVENESS, plan_options=PlanOptions(allow_drop=False))
    with JobStore.open(f"sqlite:///{work / 'store.db'}") as store:
        job_id = store.create_job(settings, items)
        with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
            broker = KillAfter(cluster, kill_after)
            status = run_job(store, job_id, broker, work / "results")
        assert status.status == "completed" and status.completed == len(items), status.error
    return broker.killed, read_results(Path(status.results_path)).to_pylist()


def test_four_distinct_samples_per_item_the_same_on_a_rerun_and_across_a_kill_9(tiny_models, tmp_path):
    model_dir = tiny_models("llama", num_hidden_layers=6)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    killed_none, first = sampled_job(model_dir, tmp_path / "a", None)
    killed, rerun = sampled_job(model_dir, tmp_path / "b", kill_after=6)
    assert killed_none == [] and killed, "the second run's middle stage was killed mid-job"

    samples: dict[str, list[str]] = {}
    for row in first:
        assert row["status"] == "completed" and row["completion_tokens"] > 0, row
        samples.setdefault(row["custom_id"], []).append(row["output"])
    assert [(r["custom_id"], r["sample_index"]) for r in first] == [
        *((f"doc-{i}", k) for i in range(6) for k in range(4)), ("single", 0)], "every sample once, in order"
    for custom_id, outputs in samples.items():
        if custom_id != "single":
            assert len(set(outputs)) == 4, f"{custom_id}: samples not distinct: {outputs}"
    assert samples["single"] == samples["doc-0"][:1], "sample 0 is what the item gives with n=1"
    keep = ("custom_id", "sample_index", "output", "finish_reason", "completion_tokens")
    assert [{k: r[k] for k in keep} for r in rerun] == [{k: r[k] for k in keep} for r in first]


def test_layerbus_run_n_writes_every_sample_to_the_parquet_and_n_choices_to_the_output_file(tiny_models, tmp_path):
    """The whole path from the CLI: --n for the job, body.n for one line, the Parquet's sample_index, the status
    counting items, and the output file's choices (validated by the openai package's types)."""
    from openai.types.chat import ChatCompletion
    from openai.types.completion import Completion

    from tests.helpers.cli import JOB_ID, layerbus, status_json, write_jsonl

    def line(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
        content = {"prompt": f"Item {custom_id} says"} if url == "/v1/completions" else {
            "messages": [{"role": "user", "content": f"Item {custom_id}, answer please."}]}
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {**content, "max_tokens": 6, **body}}

    items = [line("job-n"), line("own-n", n=2), line("text", "/v1/completions")]
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    ran = layerbus(home, "run", write_jsonl(tmp_path / "batch.jsonl", items), "--task", "generate", "--model",
                   tiny_models("llama"), "--stages", "1", "--db", db, "--n", "3", "--temperature", "0.9", timeout=300)
    assert ran.returncode == 0, ran.stderr
    job_id = JOB_ID.search(ran.stdout).group()
    status = status_json(home, job_id, "--db", db)
    assert (status["request_counts"]["total"], status["request_counts"]["completed"]) == (3, 3), "items, not samples"
    rows = read_results(Path(status["results_path"])).to_pylist()
    assert [(r["custom_id"], r["sample_index"]) for r in rows] == [
        ("job-n", 0), ("job-n", 1), ("job-n", 2), ("own-n", 0), ("own-n", 1), ("text", 0), ("text", 1), ("text", 2)]
    out = tmp_path / "out.jsonl"
    assert layerbus(home, "results", job_id, "--format", "openai", "--output", out, "--db", db).returncode == 0
    bodies = {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"] for l in out.read_text().splitlines()}
    chat, own, text = (ChatCompletion.model_validate(bodies["job-n"]), ChatCompletion.model_validate(bodies["own-n"]),
                       Completion.model_validate(bodies["text"]))
    assert [c.index for c in chat.choices] == [0, 1, 2] and [c.index for c in own.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [r["output"] for r in rows[:3]]
    assert [c.text for c in text.choices] == [r["output"] for r in rows[5:]]
    assert chat.usage.completion_tokens == sum(r["completion_tokens"] for r in rows[:3])
    assert status["tokens"]["completion"] == sum(r["completion_tokens"] for r in rows), "every sample's tokens"
