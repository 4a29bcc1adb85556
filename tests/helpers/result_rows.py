"""A job's result rows as the results writer takes them (storage/results.py), for its tests."""

from __future__ import annotations

JOB = "job_0123456789ab"


def row(custom_id: str, seq: int | None, output: str = "out") -> dict:
    return {"custom_id": custom_id, "seq": seq, "input": f"in {custom_id}", "output": output,
            "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 4, "latency_s": 0.25,
            "error": None, "status": "completed"}  # fmt: skip
