"""Records as the broker's metrics and views read them (a stage's StageInfo, a job's JobStatus), filled with
plain values a test may override, and an HTTP GET that returns the status of an error too."""

from __future__ import annotations

import urllib.error
import urllib.request

from layerbus.broker.control import StageInfo, StageState
from layerbus.storage.records import JobStatus


def stage(name: str, state: StageState = StageState.READY, stats: dict | None = None, **fields) -> StageInfo:
    values = dict(identity=name.encode(), name=name, device="cpu", dtype="float32", threads=1, memory_budget=None,
                  data_address="tcp://127.0.0.1:1", host="box", pid=1, last_seen=100.0, state=state,
                  stats=stats or {}, weights="fp32", param_bytes=1000)
    values.update(fields)
    return StageInfo(**values)


def job_status(job_id: str = "job_1", **fields) -> JobStatus:
    values = dict(job_id=job_id, name="", task="summarize", model="m", status="in_progress", timestamps={},
                  total=10, counts={"queued": 4, "in_progress": 2, "completed": 3, "failed": 1, "cancelled": 0},
                  completed=3, failed=1, cancelled=0, queued=4, in_progress=2, prompt_tokens=120,
                  completion_tokens=45, tokens_per_s=9.0, eta_s=12.5, results_path=None, error=None)
    values.update(fields)
    return JobStatus(**values)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
