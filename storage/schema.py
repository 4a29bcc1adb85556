"""The job store's tables, `jobs`, `items`, `item_counts`, `job_events`, `stage_snapshots`, `job_workers`,
`eval_runs`, `eval_metrics`, and the API server's `api_keys`, `api_files` and `api_batches`, as SQLAlchemy
declarative models.

Users query these tables with plain SQL (see storage/SCHEMA.md), so they stay flat: text states,
JSON as text, one timestamp column per job state. Timestamps are UTC: `timestamptz` on PostgreSQL,
'YYYY-MM-DD HH:MM:SS.ffffff' text (UTC, no offset) on SQLite; Python always gets aware UTC datetimes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from layerbus.storage.states import ITEM_STATES, JOB_STATES


class UtcDateTime(TypeDecorator[datetime]):
    """A datetime stored as UTC on every backend and read back timezone-aware."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            # A naive time is ambiguous (local? UTC?); refusing it keeps the stored clock honest.
            raise ValueError(
                f"naive datetime {value.isoformat()} given to the job store: pass an aware one, "
                "e.g. datetime.now(timezone.utc)"
            )
        value = value.astimezone(timezone.utc)
        # SQLite has no time zones; store naive UTC so text comparison orders correctly.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


def _one_of(column: str, values: tuple[str, ...], name: str) -> CheckConstraint:
    quoted = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"{column} IN ({quoted})", name=name)


class Base(DeclarativeBase):
    type_annotation_map: dict[Any, Any] = {datetime: UtcDateTime(), str: Text()}


class Job(Base):
    """One submitted corpus: its settings, its state, and when it entered each state."""

    __tablename__ = "jobs"
    __table_args__ = (_one_of("status", JOB_STATES, "jobs_status_valid"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # "job_" + 12 hex digits
    name: Mapped[str]  # human name given at submit; may be empty
    task: Mapped[str]  # generate, summarize, translate, ...
    model: Mapped[str]  # model name or path
    settings_json: Mapped[str]  # JobSettings as JSON text
    input_path: Mapped[str]  # input file or folder as given
    results_path: Mapped[str | None]  # final Parquet file, once written
    status: Mapped[str] = mapped_column(String(16))  # one of JOB_STATES
    total_count: Mapped[int]  # number of items, invalid ones included: status without a count(*)
    error: Mapped[str | None]  # why the job failed
    created_at: Mapped[datetime]  # entered validating (submitted)
    queued_at: Mapped[datetime | None]
    in_progress_at: Mapped[datetime | None]  # first item claimed
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    # The worker ("host:pid:token") that builds the final results file: exactly one of the job's brokers
    # takes it (JobStore.claim_finalization); kept once the job is over (who finalized it).
    finalized_by: Mapped[str | None]
    # While that worker builds the file: until when its hold runs. It renews it while writing; once past,
    # another broker may take the finalization over. NULL: no hold (none taken, or the file is written).
    finalize_lease_expires_at: Mapped[datetime | None]


class Item(Base):
    """One input item of a job and, once it has run, its result."""

    __tablename__ = "items"
    __table_args__ = (
        UniqueConstraint("job_id", "custom_id", name="items_custom_id_unique"),
        UniqueConstraint("job_id", "seq", name="items_seq_unique"),
        # Claims read "queued items of this job in seq order" from its prefix; job_status's per-state
        # counts and token sums read only this index, never the wide rows (40 MB for 10,000 documents).
        Index("items_job_status_seq", "job_id", "status", "seq", "attempts", "prompt_tokens", "completion_tokens"),
        # A long document's parts: "the items whose outputs make this one's result" (storage/document_parts.py).
        Index("items_job_parent", "job_id", "parent_id"),
        _one_of("status", ITEM_STATES, "items_status_valid"),
    )

    # BIGINT on PostgreSQL; SQLite needs exactly INTEGER PRIMARY KEY for an auto-assigned rowid.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"))
    custom_id: Mapped[str]  # the user's key; unique per job
    seq: Mapped[int] = mapped_column(Integer)  # position in the input; unique per job
    input: Mapped[str]  # the user's text as given
    prompt: Mapped[str | None]  # rendered model prompt; NULL for items refused at submit
    params_json: Mapped[str]  # per-item overrides as JSON text ("{}" when none)
    status: Mapped[str] = mapped_column(String(16))  # one of ITEM_STATES
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims so far
    claimed_by: Mapped[str | None]  # worker holding the item while in_progress ("host:pid:token"); kept once done
    claimed_at: Mapped[datetime | None]
    # While in_progress: until when the holder's lease runs. The holder renews it; once past, any worker may
    # requeue the item. NULL (a claim by a layerbus older than leases) counts as expired.
    lease_expires_at: Mapped[datetime | None]
    output: Mapped[str | None]  # generated text
    finish_reason: Mapped[str | None]  # stop, length, error, cancelled
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None]  # why the item failed
    logprobs: Mapped[str | None]  # JSON of OpenAI's choice.logprobs, when the item asked for them (added, nullable)
    # With n > 1 samples (jobs/samples.py): JSON list of every sample's output, finish_reason, completion_tokens,
    # latency_s, error and logprobs; the columns above then hold sample 0, completion_tokens the sum (added, nullable)
    samples: Mapped[str | None]
    finished_at: Mapped[datetime | None]  # entered completed, failed or cancelled
    # A long document's parts (jobs/long_documents.py; added, nullable; NULL for an item that is a whole
    # document). The custom_id of the item this one's output feeds: a reduce, or the document itself.
    parent_id: Mapped[str | None]
    # Its place among the parent's parts, from 0: the order their outputs are combined in.
    position: Mapped[int | None] = mapped_column(Integer)
    # 0 for a piece of the document's text, k for a reduce of level k (summaries of summaries at 2, ...).
    level: Mapped[int | None] = mapped_column(Integer)
    # On an item whose result is made from its parts: "reduce" (queued to run once they are done) or
    # "join" (their outputs joined in order, with no model call).
    combine: Mapped[str | None] = mapped_column(String(16))


class ItemCountRow(Base):
    """Totals over one job's items in one item state, kept in step with every item state change.

    Five rows per job (one per item state), written in the transaction that moves its items, so
    `layerbus status` reads these instead of counting a million items (storage/item_counts.py).
    """

    __tablename__ = "item_counts"

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), primary_key=True)  # one of ITEM_STATES
    items: Mapped[int] = mapped_column(BigInteger)  # items of the job in this state
    ran: Mapped[int] = mapped_column(BigInteger)  # of those, items claimed at least once (attempts > 0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)  # sum of their prompt_tokens (NULL counts as 0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)  # sum of their completion_tokens


class JobEventRow(Base):
    """One thing that happened to a running job and how long it took: a stage lost, a re-plan, a recovery."""

    __tablename__ = "job_events"
    # Reads are "the last N events of this job in order": a prefix scan of this index, newest first.
    __table_args__ = (Index("job_events_job_id_id", "job_id", "id"),)

    # Auto-assigned in insertion order, so it orders events that share a timestamp.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime]  # when it happened (for a recovery: when it ended)
    kind: Mapped[str] = mapped_column(String(32))  # stage_lost, waiting, recovered, first_token, replanned, ...
    message: Mapped[str]  # what happened, in words, naming stages, layers and times
    duration_s: Mapped[float | None] = mapped_column(Float)  # how long it took, when it is a span of time


class StageSnapshotRow(Base):
    """One stage of a running job as its broker last saw it (storage/snapshot_records.StageSnapshot).

    Each broker replaces its rows of a job every few seconds (one transaction: delete, insert), so the
    table holds one row per stage per broker, never a log; `layerbus top` reads it.
    """

    __tablename__ = "stage_snapshots"

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    broker: Mapped[str] = mapped_column(String(200), primary_key=True)  # the writing broker, "host:pid:token"
    stage: Mapped[str] = mapped_column(String(200), primary_key=True)  # the stage's name
    position: Mapped[int | None] = mapped_column(Integer)  # place in the chain; NULL: holds no span
    host: Mapped[str]  # the machine the stage registered from
    device: Mapped[str]  # cpu, cuda:N, mps
    layer_start: Mapped[int | None] = mapped_column(Integer)  # its layers [layer_start, layer_end)
    layer_end: Mapped[int | None] = mapped_column(Integer)
    weights: Mapped[str | None]  # weight format it loaded
    wire: Mapped[str | None]  # codec of its outgoing link; NULL for the last stage
    state: Mapped[str] = mapped_column(String(16))  # broker.control.StageState value
    busy_ratio: Mapped[float | None] = mapped_column(Float)  # share of the last interval spent on steps
    step_s: Mapped[float | None] = mapped_column(Float)  # mean seconds per step over the last interval
    steps: Mapped[int | None] = mapped_column(BigInteger)  # steps since the stage started
    tokens: Mapped[int | None] = mapped_column(BigInteger)  # positions processed since it started
    rss_bytes: Mapped[int | None] = mapped_column(BigInteger)  # resident memory now, if reported
    peak_rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    memory_budget_bytes: Mapped[int | None] = mapped_column(BigInteger)
    bytes_out: Mapped[int | None] = mapped_column(BigInteger)  # tensor bytes sent since it started
    bytes_in: Mapped[int | None] = mapped_column(BigInteger)  # tensor bytes received, if reported
    out_bytes_per_s: Mapped[float | None] = mapped_column(Float)  # over the last interval
    in_bytes_per_s: Mapped[float | None] = mapped_column(Float)
    heartbeat_age_s: Mapped[float | None] = mapped_column(Float)  # seconds since the broker heard from it
    updated_at: Mapped[datetime]  # when the broker wrote the row


class JobWorkerRow(Base):
    """One broker (worker) that worked a job: what it did and when it last renewed its leases.

    Several brokers may work one job; `layerbus status JOB` lists them from here (a few rows per job,
    never the items). Written when a broker starts the job, by each of its completions (same
    transaction), by each lease renewal, and when it stops.
    """

    __tablename__ = "job_workers"

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    worker: Mapped[str] = mapped_column(String(200), primary_key=True)  # "host:pid:token", as items.claimed_by
    host: Mapped[str]  # the broker's machine
    chain: Mapped[str | None]  # its chain of stages in text form ("stage-0 [0, 15) -> ..."); NULL if not known
    state: Mapped[str] = mapped_column(String(16))  # working, finalizing, stopped (storage.job_workers)
    items_done: Mapped[int] = mapped_column(BigInteger)  # items it recorded (completed or failed)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)  # tokens those items generated
    lease_s: Mapped[float] = mapped_column(Float)  # its lease: silent for longer than this, it is gone
    started_at: Mapped[datetime]  # when it started working the job (this process)
    renewed_at: Mapped[datetime]  # its last lease renewal (or completion, or stop)


class EvalRunRow(Base):
    """One eval run: the job that scored a suite's documents (its items), and what exactly was run.

    The fingerprint says whether two runs are comparable: same hash, same model, weights, dtype, codecs,
    tokenizer and settings. One row per eval job; the job's metrics are in eval_metrics.
    """

    __tablename__ = "eval_runs"
    # "Runs of this suite, newest first" (history, compare with the previous run) reads this index.
    __table_args__ = (Index("eval_runs_suite_created_at", "suite", "created_at"),)

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    suite: Mapped[str]  # suite name, or "" for an ad-hoc list of tasks
    model: Mapped[str]  # model name or path, as given
    fingerprint_hash: Mapped[str] = mapped_column(String(64))  # sha256 hex of fingerprint_json
    fingerprint_json: Mapped[str]  # canonical JSON: config/weight hashes, dtype, codecs, tokenizer, version, settings
    settings_json: Mapped[str]  # the eval's settings as JSON text (limit, few-shot, seeds, ...)
    samples_path: Mapped[str | None]  # per-document samples file, once written
    results_path: Mapped[str | None]  # results JSON in lm-evaluation-harness's layout, once written
    created_at: Mapped[datetime]  # when the run was started
    finished_at: Mapped[datetime | None]  # when its metrics were recorded; NULL while it runs or if it never finished


class EvalMetricRow(Base):
    """One aggregated metric of one task in one eval run (lm-eval's "<metric>,<filter>" result key)."""

    __tablename__ = "eval_metrics"
    # Also the index for "the metrics of this run" (its job_id prefix).
    __table_args__ = (UniqueConstraint("job_id", "task", "metric", "filter", name="eval_metrics_key_unique"),)

    # BIGINT on PostgreSQL; SQLite needs exactly INTEGER PRIMARY KEY for an auto-assigned rowid.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("eval_runs.job_id", ondelete="CASCADE"))
    task: Mapped[str]  # task name, e.g. arc_easy
    metric: Mapped[str]  # metric name, e.g. acc, acc_norm, exact_match, bits_per_byte
    filter: Mapped[str] = mapped_column(default="none", server_default="none")  # lm-eval filter; "none": unfiltered
    value: Mapped[float | None] = mapped_column(Float)  # the corpus value; NULL when it is NaN (undefined)
    stderr: Mapped[float | None] = mapped_column(Float)  # standard error; NULL when there is none (lm-eval's "N/A")
    n: Mapped[int] = mapped_column(Integer)  # documents scored for this task


class ApiKeyRow(Base):
    """One key of `layerbus serve`'s API: its name and a hash of its secret (the secret itself is never stored)."""

    __tablename__ = "api_keys"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)  # the name given at `layerbus keys api new`
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the key
    admin: Mapped[int] = mapped_column(Integer)  # 1: sees every key's files and batches
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]  # set by `layerbus keys api revoke`; the key is refused from then on


class ApiFileRow(Base):
    """One file of the OpenAI Files API: an uploaded batch input, or a finished batch's output or error file.

    The bytes live in a file of the server's files folder (`path`), never in the database.
    """

    __tablename__ = "api_files"
    # Listing "this key's files, newest first" reads this index.
    __table_args__ = (Index("api_files_owner_created_at", "owner", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "file-" + 24 hex digits
    owner: Mapped[str] = mapped_column(String(64))  # the API key's name that created it; "" without keys
    filename: Mapped[str]  # the name the upload gave (no folders), or the output file's name
    purpose: Mapped[str] = mapped_column(String(32))  # batch, batch_output
    bytes: Mapped[int] = mapped_column(BigInteger)  # size in bytes
    lines: Mapped[int] = mapped_column(BigInteger)  # JSON Lines in it
    path: Mapped[str]  # where its bytes are, on the server's machine
    created_at: Mapped[datetime]


class ApiBatchRow(Base):
    """One batch of the OpenAI Batch API. Once its input passed validation it is a layerbus job (`job_id`), and
    its state and counts are read from that job; the rows here hold what the job does not."""

    __tablename__ = "api_batches"
    __table_args__ = (Index("api_batches_owner_created_at", "owner", "created_at"),
                      Index("api_batches_status", "status"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "batch_" + 24 hex digits
    owner: Mapped[str] = mapped_column(String(64))  # the API key's name that created it; "" without keys
    input_file_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str]  # /v1/chat/completions or /v1/completions
    completion_window: Mapped[str] = mapped_column(String(16))  # as given, e.g. "24h"
    metadata_json: Mapped[str]  # the user's metadata object as JSON text ("{}" when none)
    # validating, submitted (the job's state is the batch's), failed (its input was refused), or once its files
    # are written: completed, failed, cancelled, expired
    status: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(32))  # the job its items run as, once validated
    errors_json: Mapped[str | None]  # OpenAI's errors.data list as JSON text, when validation failed
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]  # created_at + the completion window: items not done by then expire
    cancelling_at: Mapped[datetime | None]  # a cancel was asked for
    expired_at: Mapped[datetime | None]  # the window ran out before the job finished
    finished_at: Mapped[datetime | None]  # its final status was reached (files written, or validation failed)


jobs = Job.__table__
items = Item.__table__
item_counts = ItemCountRow.__table__
job_events = JobEventRow.__table__
stage_snapshots = StageSnapshotRow.__table__
job_workers = JobWorkerRow.__table__
eval_runs = EvalRunRow.__table__
eval_metrics = EvalMetricRow.__table__
api_keys = ApiKeyRow.__table__
api_files = ApiFileRow.__table__
api_batches = ApiBatchRow.__table__
