"""Storing a job's input a chunk at a time: memory stays bounded whatever the input's size.

The job is stored as validating and filled while its input is read, checked and rendered; it becomes
queued (runnable) only once the whole input passed, as OpenAI's Batch API does, and is deleted when it
did not, so a refused input leaves nothing behind. Every problem is still collected and reported with
its file:line. The first problem that refuses the input stops the storing; reading goes on to find the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from layerbus.jobs.inputs import FirstIds, unused_id
from layerbus.jobs.item_checks import ItemOutcome
from layerbus.jobs.records import InputError, InputProblem, InputRecord
from layerbus.storage.records import InvalidItem, JobSettings, NewItem
from layerbus.storage.store import JobStore

if TYPE_CHECKING:
    from layerbus.jobs.document_split import DocumentSplitter
    from layerbus.jobs.prompts import PromptRenderer

# Items per store transaction: large enough that the per-transaction cost vanishes, small enough that a
# chunk's rows stay a few MB and other writers (brokers) wait at most a moment for the write lock.
CHUNK_ITEMS = 5000


def input_text(record: InputRecord) -> str:
    """The user's input as echoed in the results: the document, the raw prompt, or the messages as JSON."""
    if record.text is not None:
        return record.text
    if record.prompt is not None:
        return record.prompt
    return json.dumps(record.messages, ensure_ascii=False)


class ItemsRefused(Exception):
    """Items read well but refused by the job (another model named, a prompt that cannot be rendered)."""

    def __init__(self, problems: list[str]) -> None:
        # One "file:line: why" per refused item, in input order.
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class _Refused:
    """A refused item kept until the end, when its record's id can be chosen knowing every id in the input."""

    custom_id: str | None
    fallback_id: str
    raw: str
    error: str
    line: int


class JobIntake:
    """One job's input on its way into the store: feed it every outcome, then finish()."""

    def __init__(self, store: JobStore, settings: JobSettings, ids: FirstIds, skip_invalid: bool, source: str,
                 chunk_items: int = CHUNK_ITEMS) -> None:
        self._store = store
        self._source = source
        self._ids = ids
        self._skip_invalid = skip_invalid
        self._chunk_items = chunk_items
        self.job_id = store.begin_job(settings)
        self._pending: list[NewItem] = []
        self._refused: list[_Refused] = []
        # Problems found reading the input (InputError), and items refused after reading (ItemsRefused).
        self.read_problems: list[InputProblem] = []
        self.item_problems: list[str] = []
        # Items valid as read; of those, items queued (after the model check and rendering).
        self.read_valid = 0
        self.queued = 0
        self._whole_file_problem = False

    def add(self, found: ItemOutcome | InputProblem,
            prepare: Callable[[InputRecord], NewItem | list[NewItem] | str]) -> None:
        """Take one outcome of the reader; `prepare` turns a valid record into its item (or a long document's
        items, jobs/document_split.py), or says why not."""
        if isinstance(found, InputProblem):
            self.read_problems.append(found)
            self._whole_file_problem = True
            return
        if found.problems or found.record is None:
            self.read_problems += found.problems
            reason = "; ".join(p.message for p in found.problems)
            self._refused.append(_Refused(found.custom_id, found.fallback_id, found.raw, reason, found.line))
            return
        self.read_valid += 1
        record = found.record
        prepared = prepare(record)
        if isinstance(prepared, str):
            self.item_problems.append(f"{record.source}:{record.line}: {prepared}")
            self._refused.append(_Refused(record.custom_id, found.fallback_id, input_text(record), prepared,
                                          record.line))
            return
        self.queued += 1
        if self._storing():
            self._pending += prepared if isinstance(prepared, list) else [prepared]
            if len(self._pending) >= self._chunk_items:
                self._flush()

    def add_all(self, found: Iterable[ItemOutcome | InputProblem],
                prepare: Callable[[InputRecord], NewItem | list[NewItem] | str]) -> None:
        """add() every outcome; when anything goes wrong on the way (Ctrl-C, the store), abandon() the job first."""
        try:
            for outcome in found:
                self.add(outcome, prepare)
        except BaseException:
            self.abandon()
            raise

    def finish(self) -> str:
        """Queue the job and return its id; InputError or ItemsRefused (nothing left in the store) when the
        input is refused: nothing valid, or problems without --skip-invalid."""
        if self._whole_file_problem or self.read_valid == 0:
            problems = sorted(self.read_problems, key=lambda p: (p.source, p.line))
            raise self._discarded(InputError(problems or [InputProblem(self._source, 0, "no items found")], 0))
        if self.read_problems and not self._skip_invalid:
            problems = sorted(self.read_problems, key=lambda p: (p.source, p.line))
            raise self._discarded(InputError(problems, self.read_valid))
        if self.item_problems and not self._skip_invalid:
            raise self._discarded(ItemsRefused(self.item_problems))
        self._flush()
        used: set[str] = set()
        invalid = [InvalidItem(r.custom_id or unused_id(r.fallback_id, self._ids.first, used), r.raw, r.error, r.line)
                   for r in self._refused]
        for start in range(0, len(invalid), self._chunk_items):
            self._store.add_items(self.job_id, [], invalid[start : start + self._chunk_items])
        self._store.set_job_status(self.job_id, "queued")
        return self.job_id

    def abandon(self) -> None:
        """Remove the job and what was stored of it (the submit was interrupted or failed).

        A job cancelled while it was being filled (`layerbus cancel` on a validating job) is left as it is:
        cancelled, so nothing of it runs, and what the user did to it stays on record.
        """
        if self._store.job_status(self.job_id).status == "validating":
            self._store.discard_job(self.job_id)

    @property
    def invalid_count(self) -> int:
        return len(self._refused)

    def _storing(self) -> bool:
        # Once the input is refused, the items read so far are dropped and no more are stored.
        return self._skip_invalid or not (self.read_problems or self.item_problems)

    def _flush(self) -> None:
        if self._pending and self._storing():
            self._store.add_items(self.job_id, self._pending)
        self._pending = []

    def _discarded(self, error: Exception) -> Exception:
        self.abandon()
        return error


def item_preparer(renderer: PromptRenderer, model_dir: Path, names: Container[str],
                  splitter: DocumentSplitter | None = None) -> Callable[[InputRecord], NewItem | list[NewItem] | str]:
    """The function that makes each record's item to queue (a long document's parts too, with `splitter`), or
    says why the job refuses it: a line naming another model (answering it with this model would give it
    another model's output), or a prompt the task cannot render. Imports once, here: it runs a million times."""
    from layerbus.jobs.item_params import item_params

    def prepare(record: InputRecord) -> NewItem | str:
        if record.model is not None and record.model not in names:
            return (f"body.model {record.model!r} is not this job's model ({model_dir.name}, {model_dir}); a job runs "
                    f"one model: give this line the job's model name, or submit the lines for {record.model!r} as "
                    "their own job with --model")
        try:
            prompt = renderer.render(record)
        except ValueError as error:
            return str(error)
        params = item_params(record.params, prompt.add_special_tokens, record.endpoint)
        item = NewItem(record.custom_id, input_text(record), prompt.text, params, record.line)
        return item if splitter is None else splitter.items(record, item)

    return prepare
