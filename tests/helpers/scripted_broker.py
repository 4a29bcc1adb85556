"""The broker played in-process by a script, for run_job's tests: requests out of claimed items, each answered
with tokens from its prompt; a job of such items queued in a store."""

from __future__ import annotations

from pathlib import Path

from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.jobs.item_params import item_params
from layerbus.storage import InvalidItem, JobSettings, JobStore, NewItem
from layerbus.storage.results import read_results


def queue_job(store: JobStore, count: int, settings: JobSettings | None = None, invalid: int = 0,
              overrides: dict[int, dict] | None = None) -> str:
    settings = settings or JobSettings(task="generate", model="tiny", max_new_tokens=4)
    overrides = overrides or {}
    items = [NewItem(f"doc-{i}", f"input {i}", f"The stage runs item {i}.",
                     item_params(overrides.get(i, {}), add_special_tokens=True), seq=i + 1)
             for i in range(count)]
    refused = [InvalidItem(f"bad-{i}", "{oops", "line is not JSON", seq=count + i + 1) for i in range(invalid)]
    return store.create_job(settings, items, refused)


class ScriptedBroker:
    """Plays Broker.run: claims `batch` requests at a time and answers each with tokens from its prompt.

    `before_deliver(round, requests)` may act (cancel the job) or raise (a crashed stage) before a batch is
    delivered; `deliver_only` caps how many of a round's results are delivered.
    """

    def __init__(self, tokenizer, batch: int = 4, before_deliver=None, deliver_only: int | None = None):
        self._tokenizer, self.batch = tokenizer, batch
        self.before_deliver, self.deliver_only = before_deliver, deliver_only
        self.requests: list[GenerationRequest] = []

    def tokenizer(self):
        return self._tokenizer

    def run(self, source, sink, should_stop, events=None):
        round_number = 0
        while not source.exhausted and not should_stop():
            batch = source.fetch(self.batch)
            self.requests += batch
            if self.before_deliver is not None:
                self.before_deliver(round_number, batch)
            results = [answer(request, self._tokenizer) for request in batch][: self.deliver_only]
            if results:
                sink.deliver(results)
            round_number += 1


def answer(request: GenerationRequest, tokenizer) -> GenerationResult:
    tokens = request.prompt_ids[: request.max_new_tokens]
    return GenerationResult(request.request_id, token_ids=tokens, text=tokenizer.decode(tokens, skip_special_tokens=True),
                            finish_reason="length", prompt_tokens=len(request.prompt_ids), latency_s=0.01)


def final_rows(path: str) -> list[dict]:
    return read_results(Path(path)).to_pylist()


class FailingBroker(ScriptedBroker):
    """Answers every request whose index (in claim order) is in `failing` with an error, the rest as usual."""

    def __init__(self, tokenizer, failing=None):
        super().__init__(tokenizer)
        self.failing, self._seen = failing, 0

    def run(self, source, sink, should_stop, events=None):
        while not source.exhausted:
            results = []
            for request in source.fetch(2):
                fails = self.failing is None or self._seen in self.failing
                results.append(GenerationResult(request.request_id, [], "error", len(request.prompt_ids),
                                                error="too long") if fails else answer(request, self._tokenizer))
                self._seen += 1
            sink.deliver(results)
