"""Tabular items, from CSV, TSV, Parquet or Arrow: which columns a table is read from, and one row checked into
an ItemOutcome."""

from __future__ import annotations

import json

from layerbus.jobs.columns import DOCUMENT_NAMES, ID_NAMES, PARAM_COLUMNS, ColumnMap, choose_columns, value_at
from layerbus.jobs.item_checks import ItemOutcome, check_id, check_params, make_record, show, unknown_names

# Every column a table may have with no column option; id (or custom_id) and text (or prompt) are required.
TABLE_COLUMNS = ("id", "custom_id", "text", "prompt", *PARAM_COLUMNS)
# Parameter columns, and for CSV (where every cell is a string) the type to read the cell as.
_PARAM_TYPES = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int, "n": int}
_NAME_THEM = ("or name the columns to read with --id-column and --text-column (--prompt-column for --task "
              "generate), and the others are ignored")


def table_columns(names: list[str], task: str, given: ColumnMap, header_line: bool = False) -> tuple[
        ColumnMap | None, list[str]]:
    """The columns to read a table by, or the whole-table problems (any of them means no row is read).
    names: the table's column names, nested fields dotted; header_line: the names are a CSV file's first line."""
    if not given.named() and {"id", "custom_id"} & set(names) and {"text", "prompt"} & set(names):
        reasons = _standard_problems(names)
        return (None, reasons) if reasons else (ColumnMap(id=_id_name(names), text="text", prompt="prompt"), [])
    chosen, reason = choose_columns(names, task, given)
    if chosen is not None:
        return chosen, []
    known = (*TABLE_COLUMNS, *ID_NAMES, *DOCUMENT_NAMES)
    if header_line and not given.named() and not any(name.lower() in known for name in names):
        # Most likely the header line is missing and this is the first item: say that first.
        shown = ", ".join(show(name, 30) for name in names[:4])
        return None, [f"the first line must be a header naming the columns, such as id,text; it holds {shown}; "
                      f"{_NAME_THEM}"]
    return None, [reason]


def _standard_problems(names: list[str]) -> list[str]:
    reasons = [f"column {i} has no name; name it or remove it" for i, name in enumerate(names, start=1) if not name]
    duplicated = sorted({name for name in names if name and names.count(name) > 1})
    if duplicated:
        reasons.append(f"column(s) {', '.join(duplicated)} appear more than once")
    unknown = [name for name in names if name and name not in TABLE_COLUMNS]
    if unknown:
        reasons.append(f"{unknown_names('column(s)', unknown, TABLE_COLUMNS)}; {_NAME_THEM}")
    if "id" in names and "custom_id" in names:
        reasons.append("give an id column or a custom_id column, not both")
    return reasons


def _id_name(names: list[str]) -> str:
    return "custom_id" if "custom_id" in names else "id"


def _read_cell(name: str, cell: str) -> object:
    """A CSV cell as the value the column holds: numbers for parameter columns when the cell parses."""
    kind = _PARAM_TYPES.get(name)
    if kind is None:
        return cell
    for parse in (kind, float):
        try:
            return parse(cell.strip())
        except ValueError:
            continue
    return cell  # not a number: the parameter check names it


def csv_values(names: list[str], cells: list[str]) -> dict[str, object]:
    """A CSV row's cells by column; an empty cell means "not given", as a missing Parquet value does."""
    return {name: _read_cell(name, cell) for name, cell in zip(names, cells) if cell != ""}


def row_outcome(values: dict[str, object], columns: ColumnMap, task: str, source: str,
                outcome: ItemOutcome) -> ItemOutcome:
    """Check one row, given its non-missing values by column name (nested fields as objects); fills and
    returns outcome."""
    custom_id, id_reasons = check_id(value_at(values, columns.id), columns.id) if columns.id else (None, [])
    given = {name: (name, values[name]) for name in PARAM_COLUMNS if values.get(name) is not None}
    params, param_reasons = check_params(given)
    content = {role: value_at(values, column) for role, column in columns.named().items() if role != "id"}
    if isinstance(content.get("messages"), str):
        content["messages"] = _messages_json(content["messages"])  # a CSV cell holds them as JSON text
    record, content_reasons = make_record(task, custom_id, _named_as(content, columns), params, source, outcome.line)
    reasons = id_reasons + _renamed(content_reasons, columns) + param_reasons
    outcome.custom_id, outcome.record = custom_id, record
    return outcome.refuse(reasons)


def _messages_json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the messages check names its type


def _named_as(content: dict[str, object], columns: ColumnMap) -> dict[str, object]:
    return {role: content.get(role) for role in ("text", "prompt", "messages")}


def _renamed(reasons: list[str], columns: ColumnMap) -> list[str]:
    """Reasons that name a role's key name the column it was read from, when that differs."""
    renamed = []
    for reason in reasons:
        for role, column in columns.named().items():
            if role != "id" and column != role and reason.startswith((f"{role} ", f"missing {role}")):
                reason = reason.replace(role, f"{column} ({role})", 1)
        renamed.append(reason)
    return renamed
