"""What reading a job's input file produces: valid items as InputRecords, and every problem found on the way.

Readers never stop at the first problem: a user with a 50,000-line corpus should see every bad line in one run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerbus.storage.records import InvalidItem


@dataclass(frozen=True)
class InputRecord:
    """One valid item of a job, in the shape the tasks and the broker use, whatever file it came from."""

    # Key of the item's result in the output; unique within the job.
    custom_id: str
    # The document, for summarize and translate; None for generate.
    text: str | None
    # Raw prompt for generate: goes to the model as is, no chat template.
    prompt: str | None
    # Chat messages ({"role", "content"}) for generate: go through the tokenizer's chat template.
    messages: list[dict] | None
    # Per-item sampling overrides actually given (max_tokens, temperature, top_p, top_k, seed, stop);
    # absent keys mean "use the job's default". stop is always a list of strings.
    params: dict = field(default_factory=dict)
    # Path of the file the item came from, as given by the user.
    source: str = ""
    # 1-based line (JSONL, CSV) or row (Parquet) number; for a directory of .txt files, the file's
    # 1-based index among the directory's .txt files in sorted order.
    line: int = 0
    # The model an OpenAI batch line names (body.model); None where the input does not say. A job runs
    # one model: submit refuses a line naming another (models.model_names).
    model: str | None = None
    # The endpoint an OpenAI batch line asked for ("/v1/chat/completions" or "/v1/completions"); None for
    # other inputs. `layerbus results --format openai` answers each line in its endpoint's form.
    endpoint: str | None = None


@dataclass(frozen=True)
class InputProblem:
    """One reason an input file, or one item in it, cannot be queued."""

    # Path of the file the problem is in (for a directory input, the file inside it when there is one).
    source: str
    # 1-based line or row number; 0 when the problem concerns a whole file rather than one line.
    line: int
    # What is wrong, naming the offending value; a single line of text.
    message: str

    def __str__(self) -> str:
        if self.line == 0:
            return f"{self.source}: {self.message}"
        return f"{self.source}:{self.line}: {self.message}"


@dataclass
class ReadResult:
    """Everything read from one input: the caller decides whether the problems stop the job."""

    # Valid items, in input order.
    records: list[InputRecord]
    # Every problem found: one per bad item reason, plus whole-file problems (missing file, unknown column).
    problems: list[InputProblem]
    # Refused items, in input order, as the store records them (seq: the item's line); whole-file
    # problems have no entry here because they are not items.
    invalid: list[InvalidItem]


class InputError(Exception):
    """An input that cannot be queued as it is; str() lists every problem and then the way out."""

    def __init__(self, problems: list[InputProblem], valid_count: int) -> None:
        # Every problem found, in input order.
        self.problems = problems
        # How many items were valid: decides whether --skip-invalid is a way out at all.
        self.valid_count = valid_count
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [str(p) for p in self.problems]
        if self.valid_count == 0:
            lines.append(
                "No valid item to queue: fix the problems above (--skip-invalid cannot help when no item is valid)."
            )
        else:
            lines.append(
                f"Fix the {len(self.problems)} problem(s) above, or pass --skip-invalid to queue the "
                f"{self.valid_count} valid item(s) and record the invalid ones as failed."
            )
        return "\n".join(lines)
