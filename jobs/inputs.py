"""Reading a job's input file into InputRecords, with every problem in it found in one pass.

Accepted inputs, chosen by extension (or by being a directory):

- ``.jsonl`` / ``.json``: JSON Lines, one object per line, in either form:
    * OpenAI batch lines ``{"custom_id", "method": "POST", "url", "body"}`` with url ``/v1/chat/completions``
      (body.messages) or ``/v1/completions`` (body.prompt). Body keys honoured: max_tokens (or
      max_completion_tokens), temperature, top_p, top_k, seed, stop; body.model, where given, must name the
      job's model (a job runs one model; submit refuses a line naming another, with its line number);
      any other key is refused rather than silently not done.
    * the simple form ``{"id": "doc-1", "text": "..."}`` (``custom_id`` may stand for ``id``), with
      ``prompt`` or ``messages`` instead of text for generate, and the same parameters as top-level keys.
- ``.csv`` / ``.tsv`` (header line required), ``.parquet``, ``.arrow`` and a folder HF ``datasets`` saved with
  ``save_to_disk``: columns id (or custom_id), text and/or prompt, and optional max_tokens, temperature,
  top_p, top_k, seed. An empty cell or null means "not given".
- Every format but a folder of .txt files takes its id and content from other columns or keys when the
  options name them (--id-column, --text-column, ...) or when they can be inferred (jobs/columns.py).
- a directory of ``.txt`` files: one item per file, id = file name without extension.

Decisions:

- Every item needs an id, in both JSONL forms: the id keys the item's result in the output, and an id
  made up from a line number would silently point at another document once the file is edited. Integer
  ids are accepted and become strings.
- summarize and translate take a document: ``text``, or in an OpenAI line the completion ``prompt`` or the
  content of the last chat message (which must be the user's; earlier messages are not used, since the task
  supplies its own instruction). generate takes ``prompt`` (sent as is), ``messages`` (sent through the
  chat template), or ``text`` (used as a raw prompt).
- An id belongs to the first item that names it; a later item with the same id is refused, and its
  failed-item record gets a synthetic id ("line-7") so failed items stay unique by id.

Nothing is queued here: load_inputs raises InputError, or with --skip-invalid hands back the valid records
and the invalid items for the caller to record as failed.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from pathlib import Path
from typing import Callable

from layerbus.jobs.arrow_inputs import arrow_outcomes, is_arrow_folder, parquet_outcomes, read_arrow, read_parquet
from layerbus.jobs.columns import NO_COLUMNS, ColumnMap
from layerbus.jobs.formats import Found, jsonl_outcomes, read_csv, read_jsonl, read_text_dir, read_tsv
from layerbus.jobs.item_checks import ItemOutcome, show
from layerbus.jobs.jsonl_items import body_model
from layerbus.jobs.records import InputError, InputProblem, ReadResult
from layerbus.storage.records import InvalidItem
from layerbus.jobs.tasks import TASKS

ACCEPTED_INPUTS = (
    "accepted: a .jsonl or .json file (JSON Lines), a .csv or .tsv file, a .parquet file, an .arrow file, a folder "
    "HF datasets saved with save_to_disk, or a directory of .txt files"
)
Reader = Callable[[Path, str, ColumnMap], Found]
# Readers by file extension; a directory with none of these extensions is read as a folder of .txt files,
# unless it holds Arrow files (a `save_to_disk` folder).
_READERS: dict[str, Reader] = {
    ".jsonl": read_jsonl,
    ".json": read_jsonl,
    ".csv": read_csv,
    ".tsv": read_tsv,
    ".parquet": read_parquet,  # a file, or a directory of part files as Spark and pyarrow write them
    ".arrow": read_arrow,
}
# The readers that stream an item at a time, for inputs too large to hold.
_STREAMS = {read_jsonl: jsonl_outcomes, read_parquet: parquet_outcomes, read_arrow: arrow_outcomes}


def read_inputs(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> ReadResult:
    """Read every item of the input at path for task; problems are collected, never raised."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose --task {', '.join(TASKS)}")
    path = Path(path)
    reader, problem = _choose_reader(path)
    outcomes, problems = reader(path, task, columns) if reader else ([], [problem])
    _refuse_duplicates(outcomes)
    return _collect(outcomes, problems)


def load_inputs(path: Path, task: str, skip_invalid: bool, columns: ColumnMap = NO_COLUMNS) -> ReadResult:
    """read_inputs, then apply the job's policy: raise InputError when nothing is valid, or when anything is
    invalid and skip_invalid is False."""
    result = read_inputs(path, task, columns)
    if not result.records:
        problems = result.problems or [InputProblem(str(path), 0, "no items found")]
        raise InputError(problems, valid_count=0)
    if result.problems and not skip_invalid:
        raise InputError(result.problems, valid_count=len(result.records))
    return result


def _choose_reader(path: Path) -> tuple[Reader | None, InputProblem | None]:
    if not path.exists():
        return None, InputProblem(str(path), 0, f"does not exist; {ACCEPTED_INPUTS}")
    suffix = path.suffix.lower()
    reader = _READERS.get(suffix)
    if reader is not None and path.is_dir() and suffix not in (".parquet", ".arrow"):
        message = (f"is a directory, but a {suffix} input must be a file; a directory of .txt files "
                   "is read as one item per file when its name has no such extension")
        return None, InputProblem(str(path), 0, message)
    if reader is not None:
        return reader, None
    if is_arrow_folder(path):
        return read_arrow, None
    if path.is_dir():
        return read_text_dir, None
    return None, InputProblem(str(path), 0, f"unknown input kind {suffix or '(no extension)'!r}; {ACCEPTED_INPUTS}")


def _refuse_duplicates(outcomes: list[ItemOutcome]) -> None:
    ids = FirstIds()
    for outcome in outcomes:
        ids.check(outcome)


class FirstIds:
    """Each id's first item, for refusing later items that repeat it: an id belongs to its first item.

    Keeps the id and where its item is (its line or row number where that says it, as an int: one input
    numbers all its items one way), not the item, so a million-line input costs a dict of a million short
    strings.
    """

    def __init__(self) -> None:
        self.first: dict[str, int | str] = {}
        self._numbered_as = "line"  # what an int in `first` counts: lines, or a table's rows

    def check(self, outcome: ItemOutcome) -> None:
        if outcome.custom_id is None:
            return
        earlier = self.first.get(outcome.custom_id)
        if earlier is None:
            word = outcome.where.split(" ", 1)[0]
            numbered = word in ("line", "row") and outcome.where == f"{word} {outcome.line}"
            if numbered:
                self._numbered_as = word
            self.first[outcome.custom_id] = outcome.line if numbered else outcome.where
            return
        earlier_text = f"{self._numbered_as} {earlier}" if isinstance(earlier, int) else earlier
        outcome.refuse([f"duplicate id {show(outcome.custom_id)}: {earlier_text} has it already"])
        outcome.custom_id = None  # the failed-item record must not reuse the id the first item holds


def stream_outcomes(path: Path, task: str, ids: FirstIds, columns: ColumnMap = NO_COLUMNS) -> Iterator[
        ItemOutcome | InputProblem]:
    """Every item of the input at path, checked (a repeated id refused: `ids` keeps them), as it is read,
    and the problems of the whole file: JSON Lines one line at a time, Parquet and Arrow a record batch at
    a time, other kinds whole."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose --task {', '.join(TASKS)}")
    path = Path(path)
    reader, problem = _choose_reader(path)
    if reader is None:
        yield problem  # type: ignore[misc]
        return
    stream = _STREAMS.get(reader)
    found = stream(path, task, columns) if stream else _outcomes_then_problems(reader(path, task, columns))
    for outcome in found:
        if isinstance(outcome, ItemOutcome):
            ids.check(outcome)
        yield outcome


def input_problem(path: Path) -> InputProblem | None:
    """Why the input at path cannot be read at all (missing, an unknown kind), or None."""
    return _choose_reader(Path(path))[1]


def named_models(path: Path) -> set[str]:
    """The models the lines of a JSON Lines input name (body.model); empty for other inputs. A quick pass:
    only lines mentioning "model" are parsed, and a line that does not parse is left to the real reading."""
    if _READERS.get(Path(path).suffix.lower()) is not read_jsonl or not Path(path).is_file():
        return set()
    names = set()
    with Path(path).open("rb") as lines:
        for data in lines:
            if b'"model"' in data:
                name = body_model(data)
                if name is not None:
                    names.add(name)
    return names


def _outcomes_then_problems(found: Found) -> Iterator[ItemOutcome | InputProblem]:
    outcomes, problems = found
    yield from outcomes
    yield from problems


def unused_id(candidate: str, taken: Container[str], used: set[str]) -> str:
    """candidate, or candidate-2, -3, ... when an item's own id (in `taken`) or an earlier fallback (in
    `used`) already is that string."""
    name, n = candidate, 1
    while name in taken or name in used:
        n += 1
        name = f"{candidate}-{n}"
    used.add(name)
    return name


def _collect(outcomes: list[ItemOutcome], problems: list[InputProblem]) -> ReadResult:
    taken = {o.custom_id for o in outcomes if o.custom_id is not None}
    records, invalid, problems = [], [], list(problems)
    for outcome in outcomes:
        if not outcome.problems and outcome.record is not None:
            records.append(outcome.record)
            continue
        custom_id = outcome.custom_id or _unused(outcome.fallback_id, taken)
        reason = "; ".join(p.message for p in outcome.problems)
        invalid.append(InvalidItem(custom_id, outcome.raw, reason, outcome.line))
        problems += outcome.problems
    # Stable sort: a directory's problems come out by file name, a file's by line, whole-file ones first.
    problems = sorted(problems, key=lambda p: (p.source, p.line))
    return ReadResult(records=records, problems=problems, invalid=invalid)


def _unused(candidate: str, taken: set[str]) -> str:
    """candidate, or candidate-2, -3, ... when an item's own id already is that string."""
    name, n = candidate, 1
    while name in taken:
        n += 1
        name = f"{candidate}-{n}"
    taken.add(name)
    return name
