"""The values that go in and out of the job store: what a job is made of, what a broker claims and
reports back, and the status a user sees."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Any

# What status shows lives apart, so `layerbus status` builds it without the six records above (their
# dataclasses take most of this module's import time); re-exported here for everything else.
from layerbus.storage.status_records import JobEvent, JobStatus, JobWorker  # noqa: F401


@dataclass(frozen=True)
class JobSettings:
    """How every item of a job is run; stored as JSON in jobs.settings_json (and a few columns for SQL)."""

    # The task that renders prompts: "generate", "summarize", "translate", ...
    task: str
    # Model name or path, as given to `layerbus submit`.
    model: str
    # Default generation length; an item's params["max_tokens"] overrides it.
    max_new_tokens: int = 256
    # Default sampling temperature; 0 means greedy.
    temperature: float = 0.0
    # Default nucleus sampling mass; 1.0 keeps every token.
    top_p: float = 1.0
    # Default top-k cut; 0 keeps every token.
    top_k: int = 0
    # Default sampling seed, so a rerun of the job samples the same outputs.
    seed: int = 0
    # Language to translate into, for the translate task; None for other tasks.
    target_language: str | None = None
    # Human name of the job, shown by `layerbus status`; empty means none given.
    name: str = ""
    # Input file or folder, as the user gave it.
    input_path: str = ""
    # Settings a task adds beyond these (e.g. "stop"); kept verbatim in settings_json.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSettings:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        # Keys written by a newer layerbus survive a round trip through an older one.
        extra = {**data.pop("extra", {}), **{k: data.pop(k) for k in list(data) if k not in known}}
        return cls(**data, extra=extra)


@dataclass(frozen=True)
class NewItem:
    """One valid input item, ready to queue."""

    # The user's key for the item; unique within the job.
    custom_id: str
    # The user's text as given (document, prompt or JSON messages), echoed in the results.
    input: str
    # The rendered model prompt text the stages tokenize; None for a reduce, whose prompt is made from its
    # parts' outputs when it is claimed.
    prompt: str | None
    # Per-item overrides of the job settings: max_tokens, temperature, top_p, top_k, seed, stop.
    params: dict[str, Any]
    # Position in the input (0- or 1-based, the caller's choice); unique within the job; results keep this order.
    seq: int
    # A part of a long document (jobs/long_documents.py): the custom_id of the item its output feeds, its
    # place among that item's parts, its level (0: a piece of the text; k: a reduce of level k), and for an
    # item made from parts how ("reduce" or "join"). None for an item that is a whole document.
    parent_id: str | None = None
    position: int | None = None
    level: int | None = None
    combine: str | None = None

    @property
    def status(self) -> str:
        """The state it is stored in: an item made from its parts waits for them."""
        return "waiting" if self.combine is not None else "queued"


@dataclass(frozen=True)
class InvalidItem:
    """An input item refused at submit (by the input readers or the prompt renderer); stored directly
    as a failed item so it appears in the results."""

    # The user's key, or a synthetic one ("line-7", "row-7") when it has none or its id repeats an
    # earlier item's, so failed items stay unique by id.
    custom_id: str
    # The input as the user wrote it (the JSONL line, the CSV row's text, the .txt file's content).
    input: str
    # Every reason it was refused, joined by "; ", naming the offending values.
    error: str
    # Position in the input, on the same scale as NewItem.seq (the readers' 1-based line or row).
    seq: int


@dataclass(frozen=True)
class ClaimedItem:
    """An item a worker now owns (status in_progress) until it completes or requeues it."""

    # items.id: the handle for complete_items / requeue_items.
    item_id: int
    # The job the item belongs to.
    job_id: str
    # The user's key, for logs and results.
    custom_id: str
    # Position in the input (items.seq): orders the results and derives the item's default seed.
    seq: int
    # The user's text as given.
    input: str
    # The rendered model prompt text.
    prompt: str
    # Per-item overrides of the job settings.
    params: dict[str, Any]
    # How many times the item has been claimed, this claim included (1 on the first run).
    attempts: int
    # A long document's part: the custom_id of the item its output feeds (None: a whole document), and
    # for an item made from its parts, how ("reduce": its prompt is made from their outputs when claimed).
    parent_id: str | None = None
    combine: str | None = None


@dataclass(frozen=True)
class Lease:
    """What one worker holds of a job: its items in flight and when the first of their leases runs out."""

    # items.claimed_by: the worker holding them ("host:pid:token" for layerbus brokers).
    holder: str
    # Its in_progress items in the job.
    items: int
    # The earliest end of their leases, UTC; None when one of them has none (claimed by a layerbus older
    # than leases), which counts as expired.
    expires_at: datetime | None

    def expired(self, now: datetime) -> bool:
        return self.expires_at is None or self.expires_at < now


@dataclass(frozen=True)
class Finalization:
    """Who builds a job's final results file, as JobStore.claim_finalization answers (storage/finalization.py)."""

    # True when the asking worker holds the finalization now (it moved the job to finalizing, or took over
    # from a finalizer that is gone): it, and only it, writes the file and ends the job.
    claimed: bool
    # The job's status after the claim: finalizing when claimed, otherwise whatever it is.
    status: str
    # The worker finalizing (or that finalized) the job, or None when none has.
    holder: str | None
    # Until when that worker's hold runs, UTC; None once the file is written, or when nobody holds it.
    expires_at: datetime | None


@dataclass(frozen=True)
class ItemResult:
    """What a worker reports for one claimed item."""

    # items.id from the ClaimedItem.
    item_id: int
    # Generated text; None when the item failed before producing any.
    output: str | None
    # "stop", "length", "error" or "cancelled".
    finish_reason: str
    # Prompt length in tokens.
    prompt_tokens: int
    # Generated length in tokens.
    completion_tokens: int
    # Seconds from admission to finish, by the broker's clock.
    latency_s: float
    # Why the item failed; when set the item is stored as failed, otherwise as completed.
    error: str | None = None
    # Log-probabilities of the generated tokens when the item asked for them: JSON text of OpenAI's chat
    # choice.logprobs object ({"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}); else None.
    logprobs: str | None = None
    # With n > 1 samples: JSON of every sample (jobs/samples.samples_json); the fields above then describe
    # sample 0, completion_tokens is the sum over samples and error the first sample's error. Else None.
    samples: str | None = None

    @property
    def status(self) -> str:
        """The item state this result leaves the item in."""
        return "failed" if self.error is not None else "completed"
