"""The documents an eval task is made of, one dataclass per kind of request, and the problems a task file can have.

Kinds carry lm-evaluation-harness's `output_type` names, so a task's kind reads the same in both tools.
Whatever a task came from (a JSONL/Parquet task file or a task YAML), the pipeline sees these documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

MULTIPLE_CHOICE = "multiple_choice"
LOGLIKELIHOOD = "loglikelihood"
ROLLING = "loglikelihood_rolling"
GENERATION = "generate_until"
KINDS = (MULTIPLE_CHOICE, LOGLIKELIHOOD, ROLLING, GENERATION)
# How messages name a kind to a user.
KIND_NAMES = {
    MULTIPLE_CHOICE: "multiple choice",
    LOGLIKELIHOOD: "log-likelihood",
    ROLLING: "rolling log-likelihood",
    GENERATION: "generation",
}


@dataclass(frozen=True)
class MultipleChoiceDoc:
    """A question scored by the log-likelihood of each choice after the context (acc, acc_norm)."""

    # Unique within the task; keys the document's row in the samples file.
    id: str
    # Text every choice continues; may be empty (the model's prefix token then stands in for it).
    context: str
    # Continuations scored as written: context + choice is the scored text, so the separating space
    # belongs at the end of the context or the start of each choice (trailing context spaces move to the
    # choice when tokenizing, as lm-evaluation-harness does).
    choices: tuple[str, ...]
    # Indices of the correct choices (lm-eval accepts a list of golds: any of them counts as correct).
    gold: tuple[int, ...]
    # Cluster for clustered standard errors (documents sharing a passage, a source...); None: own cluster.
    group: str | None = None
    # Put before each choice when scoring (a task YAML's target_delimiter, " " by default there; "" for task
    # files). Kept apart because acc_norm divides by the length of the choice alone, as lm-eval does.
    target_delimiter: str = ""


@dataclass(frozen=True)
class LoglikelihoodDoc:
    """One (context, continuation) pair: its log-likelihood and whether greedy decoding would produce it."""

    # Unique within the task.
    id: str
    # Conditioning text; may be empty.
    context: str
    # Scored text; never empty.
    continuation: str
    # Cluster for clustered standard errors.
    group: str | None = None


@dataclass(frozen=True)
class RollingDoc:
    """A text scored whole, in lm-eval's rolling windows (perplexity, bits per byte)."""

    # Unique within the task.
    id: str
    # The document; its words and UTF-8 bytes are the denominators of word/byte perplexity.
    text: str
    # Cluster for clustered standard errors.
    group: str | None = None


@dataclass(frozen=True)
class GenerationDoc:
    """A prompt answered by generation and scored against accepted answers (exact_match)."""

    # Unique within the task.
    id: str
    # Raw prompt sent as is; None when messages are given.
    prompt: str | None
    # Chat messages ({"role", "content"} dicts) sent through the chat template; None when prompt is given.
    messages: tuple[dict, ...] | None
    # Accepted answers; the generation matches when it equals any of them (after the task's filters).
    targets: tuple[str, ...]
    # Stop strings; generation ends before the first one. Empty: only EOS and max_gen_toks stop it.
    until: tuple[str, ...] = ()
    # Most new tokens; None means the task's (or the run's) default.
    max_gen_toks: int | None = None
    # Cluster for clustered standard errors.
    group: str | None = None


Document = Union[MultipleChoiceDoc, LoglikelihoodDoc, RollingDoc, GenerationDoc]
DOC_TYPES = {
    MULTIPLE_CHOICE: MultipleChoiceDoc,
    LOGLIKELIHOOD: LoglikelihoodDoc,
    ROLLING: RollingDoc,
    GENERATION: GenerationDoc,
}


@dataclass(frozen=True)
class TaskProblem:
    """One reason a task file (or a row in it) cannot be used; prints as `file:line: message`."""

    # Path of the file, as the user gave it.
    source: str
    # 1-based line (JSONL) or row (Parquet, CSV data row) number; 0 for the whole file.
    line: int
    # What is wrong, naming the offending value and the way out; one line.
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.message}" if self.line == 0 else f"{self.source}:{self.line}: {self.message}"


class TaskFileError(ValueError):
    """A task cannot be used; carries every problem found, in file order."""

    def __init__(self, problems: list[TaskProblem]):
        self.problems = list(problems)
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        super().__init__(f"{count}; nothing was queued:\n" + "\n".join(str(p) for p in problems))
