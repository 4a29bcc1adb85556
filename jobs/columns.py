"""Which of an input's columns (or a JSON object's keys) hold each item's id and content.

Given on the command line (--id-column, --text-column, --prompt-column, --messages-column), or inferred
from the names found when only one column fits a role. A name may reach into a nested field with dots
(`translation.de`): a Parquet or Arrow struct column, or a JSON object inside a JSON Lines item.

Decisions:

- The layout every format accepted before names existed (`id` or `custom_id`, and `text`, `prompt` or
  `messages`) needs no option, and keeps its strict check: an unknown column is refused (most likely a
  typo of a parameter column), with the way out of naming the columns to read.
- Once a column is named, or inferred under another name (`doc_id`, `article`), the input is a dataset
  of its own shape: the columns not used are ignored, as lm-evaluation-harness's `doc_to_text` and HF
  `datasets` ignore them. Parameter columns (max_tokens, ...) are still read under their own names.
- A role that cannot be filled, or could be filled by more than one column, is one message for the whole
  input, which lists the columns found and the option to pass.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

# Each role's option, as the command line spells it.
OPTIONS = {"id": "--id-column", "text": "--text-column", "prompt": "--prompt-column",
           "messages": "--messages-column"}
# The names each role takes with no option, in the order the formats have always read them.
STANDARD = {"id": ("custom_id", "id"), "text": ("text",), "prompt": ("prompt",), "messages": ("messages",)}
# Names that datasets give their ids and their documents; one of them is inferred when it is the only one.
ID_NAMES = ("doc_id", "document_id", "example_id", "article_id", "item_id", "uid", "guid", "uuid", "key", "idx",
            "_id", "index")
DOCUMENT_NAMES = ("document", "article", "body", "content", "passage", "context", "source", "input", "abstract",
                  "story", "transcript", "report", "dialogue", "src")
# Parameter columns a table may carry beside its content, under their own names.
PARAM_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n")


@dataclass(frozen=True)
class ColumnMap:
    """The column each role is read from; None: the role is not read (or, as given, not named)."""

    # The item's id (its result's key in the output).
    id: str | None = None
    # The document (summarize, translate) or a raw prompt (generate).
    text: str | None = None
    # A raw prompt, sent as is (generate).
    prompt: str | None = None
    # Chat messages, through the chat template (generate).
    messages: str | None = None

    def named(self) -> dict[str, str]:
        """The roles with a column, role -> column."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def is_standard(self) -> bool:
        """True when every role is read under the name the formats read with no option."""
        return all(column in STANDARD[role] for role, column in self.named().items())


NO_COLUMNS = ColumnMap()


def column_options(args: object) -> ColumnMap:
    """The column options of a parsed command line (absent ones are None)."""
    return ColumnMap(**{role: getattr(args, f"{role}_column", None) for role in OPTIONS})


def content_roles(task: str) -> tuple[str, ...]:
    """The roles that may hold an item's content for task."""
    return ("text",) if task in ("summarize", "translate") else ("prompt", "messages", "text")


def choose_columns(names: list[str], task: str, given: ColumnMap, found_in: str = "columns found") -> tuple[
        ColumnMap | None, str | None]:
    """The columns to read, from the names an input has (dotted for nested fields) and the options given;
    or None and the one message that says what is missing or ambiguous, the names found and the option."""
    refused = _refused_options(given, task)
    if refused:
        return None, refused
    missing = [f"{OPTIONS[role]} {column!r}" + _close(column, names) for role, column in given.named().items()
               if column not in names]
    if missing:
        return None, f"no column {', '.join(missing)}; {found_in}: {_listed(names)}"
    chosen = dict(given.named())
    troubles = []
    if "id" not in chosen:
        column, trouble = _infer(names, STANDARD["id"], ID_NAMES, "id", chosen.values(), suffix="_id")
        chosen.update({"id": column} if column else {})
        troubles += [trouble] if trouble else []
    if not any(role in chosen for role in content_roles(task)):
        content, trouble = _infer_content(names, task, chosen.values())
        chosen.update(content)
        troubles += [trouble] if trouble else []
    if troubles:
        options = " ".join(f"{OPTIONS[role]} NAME" for role in ("id", "text") if role not in chosen)
        return None, f"{'; '.join(troubles)}; {found_in}: {_listed(names)}; pass {options}"
    return ColumnMap(**chosen), None


def _refused_options(given: ColumnMap, task: str) -> str | None:
    if task in ("summarize", "translate"):
        wrong = [OPTIONS[role] for role in ("prompt", "messages") if role in given.named()]
        if wrong:
            return (f"{' and '.join(wrong)} is for --task generate; for --task {task} name the document's "
                    "column with --text-column")
    columns = list(given.named().values())
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        return f"column {repeated[0]!r} is named for two roles; each option names its own column"
    return None


def _infer(names: list[str], standard: tuple[str, ...], known: tuple[str, ...], role: str, taken,
           suffix: str = "") -> tuple[str | None, str | None]:
    """The one column for role: a standard name, else the one known name, else the one name ending in
    suffix; or None and why not."""
    free = [name for name in names if name not in taken]
    at_top = [name for name in free if "." not in name]
    for tier in ([n for n in at_top if n in standard],
                 [n for n in at_top if n.lower() in known],
                 [n for n in at_top if suffix and n.lower().endswith(suffix)]):
        if len(tier) == 1:
            return tier[0], None
        if len(tier) > 1:
            if set(tier) == {"id", "custom_id"}:
                return None, "give an id column or a custom_id column, not both"
            return None, f"more than one column could hold the {role} ({', '.join(tier)})"
    return None, f"no {role} column: none is named {' or '.join(standard)}"


def _infer_content(names: list[str], task: str, taken) -> tuple[dict[str, str], str | None]:
    free = [name for name in names if name not in taken]
    standard = {role: STANDARD[role][0] for role in content_roles(task) if STANDARD[role][0] in free}
    if standard:
        return standard, None  # generate reads each row's one content of text, prompt and messages
    rest = [name for name in free if name not in PARAM_COLUMNS]
    column, trouble = _infer(rest, (), DOCUMENT_NAMES, "text", ())
    if column is None and len(rest) == 1 and "." not in rest[0]:
        column, trouble = rest[0], None  # the only column left holds the content
    if column is None and "more than one" not in (trouble or ""):
        trouble = "no content column: none is named " + ("text, prompt or messages" if task == "generate" else "text")
    return ({"text": column} if column else {}), trouble


def _listed(names: list[str], limit: int = 24) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "") if names else "(none)"


def _close(column: str, names: list[str]) -> str:
    close = difflib.get_close_matches(column, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def value_at(row: dict, column: str) -> object:
    """A row's value of column: the key itself, else a dotted path into nested objects; None when absent."""
    if column in row:
        return row[column]
    value: object = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def nested_names(row: dict, prefix: str = "") -> list[str]:
    """Every key of a JSON object, with the dotted paths of the keys of the objects inside it."""
    names = []
    for key, value in row.items():
        names.append(prefix + key)
        if isinstance(value, dict):
            names += nested_names(value, f"{prefix}{key}.")
    return names
