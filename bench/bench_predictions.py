"""How well the plan predicts what runs: predicted against measured tokens/s, per case and per stage,
on the README's command and the pipeline and placement benchmarks' cases.

  readme       `layerbus run examples/sample_corpus --task summarize` (3 local stages, all defaults),
               run through the CLI in this process, in a fresh LAYERBUS_HOME
  readme-again the same command again in the same home: the store now knows where this model's
               summaries ended, and the plan expects outputs to end there
  pipeline-2   bench_pipeline.py's layerbus run on 2 stages (128 prompts, 128 new tokens, its batching), its
               workload told as `layerbus run` tells a first job (outputs assumed to end evenly up to the budget)
  pipeline-3   the same on 3 stages
  A-equal, A-planned   bench_placement.py's scenario A (2 stages at emulated speeds 1.0 and 0.33), told as
                       bench_placement tells it: every item may run to its budget
  B-planned, B-equal   scenario B (3 stages at 0.33, the middle one with 300MB; the best equal split
                       that fits is the two large stages, 15 + 15)

Every figure comes from the broker's own log: the plan it logs when it places the model and, after
the run, its per-stage report of predicted against measured busy time per step. Measured tokens/s:
new tokens over the run's wall time (the CLI case: the store's tokens/s for the job).

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_predictions.py
    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_predictions.py --cases A-planned
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_prompts  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
CASES = ("readme", "readme-again", "pipeline-2", "pipeline-3", "A-equal", "A-planned", "B-planned", "B-equal")
TOLERANCE = 0.15


class BrokerLog(logging.Handler):
    """Keeps the broker's INFO records of one run."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "BrokerLog":
        logger = logging.getLogger("layerbus.broker")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("layerbus.broker")
        logger.removeHandler(self)
        logger.setLevel(self._level)

    def predictions(self) -> dict:
        """{"tok_s": predicted tokens/s, "stages": {name: {...}}} from this run's records."""
        for record in reversed(self.records):  # the report after the run carries everything (new broker)
            report = getattr(record, "prediction", None)
            if report is not None:
                return report
        # A broker without the report after the run (an older checkout under bench_checkouts) logs the plan's
        # table and one line per stage after the run: read those.
        out: dict = {"tok_s": None, "stages": {}}
        for record in self.records:
            text = record.getMessage()
            match = re.match(r"planned: ([\d.]+) tok/s predicted", text)
            if match and out["tok_s"] is None:
                out["tok_s"] = float(match.group(1))
            match = re.match(r"stage (\S+) (\[\d+, \d+\)): predicted ([\d.]+) ms/step, measured ([\d.]+) ms over (\d+)",
                             text)
            if match:
                out["stages"][match.group(1)] = {"layers": match.group(2),
                                                 "predicted_ms_per_step": float(match.group(3)),
                                                 "measured_ms_per_step": float(match.group(4)),
                                                 "steps": int(match.group(5))}
        return out


def broker_config(model_dir: Path, stages: int, batching: BatchingConfig, partition: str, prompts,
                  max_new_tokens: int, as_first_job: bool) -> BrokerConfig:
    """The config, telling the broker the workload where it can be told.
    `as_first_job`: told as `layerbus run` tells it for a job nothing like has run before (outputs assumed
    to end evenly up to their budgets, jobs.job_workload); else as bench_placement tells it (every item
    may run to its budget)."""
    fields = {f.name for f in dataclasses.fields(BrokerConfig)}
    extra = {}
    if "workload" in fields:
        from layerbus.planner import workload as workloads

        workload = workloads.Workload.of_prompts([ids for _, ids in prompts], max_new_tokens)
        if as_first_job and hasattr(workloads, "ASSUMED_OUTPUT_SHARES"):
            workload = workload.with_output_shares(workloads.ASSUMED_OUTPUT_SHARES, assumed=True)
        extra["workload"] = workload
    else:  # before: the planner was told the prompt/new-token ratio
        from layerbus.planner.placement import PlanOptions

        ratio = sum(len(ids) for _, ids in prompts) / (len(prompts) * max_new_tokens)
        extra["plan_options"] = PlanOptions(prompt_tokens_per_new_token=ratio)
    return BrokerConfig(str(model_dir), stages, partition=partition, batching=batching, **extra)


def run_cluster(name: str, model_dir: Path, prompts, max_new_tokens: int, batching: BatchingConfig, partition: str,
                stage_args: list[tuple[str, ...]], threads: int, as_first_job: bool = False) -> dict:
    config = broker_config(model_dir, len(stage_args), batching, partition, prompts, max_new_tokens, as_first_job)
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens) for pid, ids in prompts]
    print(f"== {name}: {len(stage_args)} stage(s), {partition}", file=sys.stderr, flush=True)
    with BrokerLog() as broker_log:
        with LocalCluster(config, LocalStageOptions(threads_per_stage=threads, stage_args=tuple(stage_args))) as cluster:
            chain = [(stage.name, str(span)) for stage, span in zip(cluster.broker.chain, cluster.broker.spans)]
            results, stats = cluster.broker.generate(requests)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} requests failed, first: {errors[0]}")
    new = sum(len(r.token_ids) for r in results)
    predicted = broker_log.predictions()
    measured_stages = {n: {"busy_s": s.get("busy_s", 0.0), "steps": s.get("steps", 0)}
                       for n, s in stats.stage_stats.items()}
    return {"case": name, "partition": partition, "chain": chain, "new_tokens": new, "wall_s": stats.wall_s,
            "measured_tok_s": new / stats.wall_s, "predicted": predicted, "measured_stages": measured_stages}


def run_readme(model_dir: Path, name: str = "readme", home: str | None = None) -> dict:
    """The README's main command, through the CLI, in a fresh home (its own store and profile cache)
    or in `home` again."""
    from layerbus.cli.main import main as cli_main
    from layerbus.storage import JobStore, default_db_url

    home = home or tempfile.mkdtemp(prefix="layerbus-bench-predictions-")
    previous = os.environ.get("LAYERBUS_HOME")
    os.environ["LAYERBUS_HOME"] = home
    print(f"== {name}: layerbus run examples/sample_corpus --task summarize", file=sys.stderr, flush=True)
    try:
        started = time.perf_counter()
        with BrokerLog() as broker_log:
            code = cli_main(["run", str(REPO / "examples" / "sample_corpus"), "--task", "summarize",
                             "--model", str(model_dir)])
        wall = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"readme: layerbus run exited {code}")
        with JobStore.open(default_db_url()) as store:
            job = store.latest_job_id()
            status = store.job_status(job)
    finally:
        if previous is None:
            os.environ.pop("LAYERBUS_HOME", None)
        else:
            os.environ["LAYERBUS_HOME"] = previous
    return {"case": name, "home": home, "partition": "planned", "new_tokens": status.completion_tokens,
            "wall_s": status.completion_tokens / status.tokens_per_s, "command_wall_s": wall,
            "measured_tok_s": status.tokens_per_s, "predicted": broker_log.predictions(), "measured_stages": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--pipeline-prompts", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_predictions.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer

    model_dir = args.model or default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    cores = os.cpu_count() or 1
    rows = []
    for case in args.cases:
        if case == "readme":
            rows.append(run_readme(model_dir))
        elif case == "readme-again":
            first = next((row for row in rows if row["case"] == "readme"), None)
            rows.append(run_readme(model_dir, case, first["home"] if first else None))
        elif case.startswith("pipeline-"):
            stages = int(case.split("-")[1])
            prompts = tokenized_prompts(tokenizer, args.pipeline_prompts)
            # bench_pipeline.py's settings: batch sizes chosen by the broker, as `layerbus run` does.
            batching = BatchingConfig(micro_batch_size=0, max_step_tokens=0, max_context=4096)
            rows.append(run_cluster(case, model_dir, prompts, 128, batching, "planned", [()] * stages,
                                    max(1, cores // stages), as_first_job=True))
        elif case.startswith("A-"):
            prompts = tokenized_prompts(tokenizer, 48)
            batching = BatchingConfig(micro_batch_size=16, max_context=768)
            stage_args = [("--emulate-speed", "1.0"), ("--emulate-speed", "0.33")]
            rows.append(run_cluster(case, model_dir, prompts, 24, batching, case.split("-")[1], stage_args, 1))
        elif case.startswith("B-"):
            prompts = tokenized_prompts(tokenizer, 48)
            batching = BatchingConfig(micro_batch_size=16, num_micro_batches=4, max_context=768)
            speed = ("--emulate-speed", "0.33")
            if case == "B-planned":
                stage_args = [speed, (*speed, "--emulate-memory", "300MB"), speed]
            else:  # the best equal split that fits: the two large stages, 15 + 15
                stage_args = [speed, speed]
            rows.append(run_cluster(case, model_dir, prompts, 24, batching, case.split("-")[1], stage_args, 1))
    for row in rows:
        predicted = row["predicted"].get("tok_s")
        row["predicted_tok_s"] = predicted
        row["error"] = row["measured_tok_s"] / predicted - 1 if predicted else None
    report = {"model": str(model_dir), "cores": cores, "tolerance": TOLERANCE, "rows": rows}
    by_case = {row["case"]: row for row in rows}
    if "A-equal" in by_case and "A-planned" in by_case:
        report["A_planned_over_equal"] = by_case["A-planned"]["measured_tok_s"] / by_case["A-equal"]["measured_tok_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print_tables(report)
    print(f"\nwritten to {args.out}")


def print_tables(report: dict) -> None:
    print("\n| case | tok/s predicted | tok/s measured | measured vs predicted | within 15%? "
          "| predicted for the output lengths produced | measured vs that |")
    print("|---|---|---|---|---|---|---|")
    for row in report["rows"]:
        predicted = row["predicted_tok_s"]
        error = row["error"]
        produced = row["predicted"].get("tok_s_for_produced_lengths")
        tail = (f" {produced:.1f} | {row['measured_tok_s'] / produced - 1:+.0%} |" if produced else " - | - |")
        print((f"| {row['case']} | {predicted:.1f} | {row['measured_tok_s']:.1f} | {error:+.0%} | "
               f"{'yes' if abs(error) <= TOLERANCE else 'no'} |" if predicted else
               f"| {row['case']} | - | {row['measured_tok_s']:.1f} | - | - |") + tail)
    if "A_planned_over_equal" in report:
        print(f"\nscenario A: planned / equal measured {report['A_planned_over_equal']:.2f}x (target >= 2.0x)")
    print("\n| case | stage | layers | busy ms/step predicted | measured | steps | tok/s at its busy time predicted | measured |")
    print("|---|---|---|---|---|---|---|---|")
    for row in report["rows"]:
        for name, stage in sorted(row["predicted"].get("stages", {}).items()):
            fields = [row["case"], name, stage.get("layers", "-"), _fmt(stage.get("predicted_ms_per_step")),
                      _fmt(stage.get("measured_ms_per_step")), str(stage.get("steps", "-")),
                      _fmt(stage.get("predicted_tok_s")), _fmt(stage.get("measured_tok_s"))]
            print("| " + " | ".join(fields) + " |")


def _fmt(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


if __name__ == "__main__":
    main()
