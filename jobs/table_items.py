"""Tabular items, from CSV or Parquet: which columns a table may have, and one row checked into an ItemOutcome."""

from __future__ import annotations

from layerbus.jobs.item_checks import ItemOutcome, check_id, check_params, make_record, show, unknown_names

# Every column a CSV or Parquet input may have; id (or custom_id) and text (or prompt) are required.
TABLE_COLUMNS = ("id", "custom_id", "text", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "n")
# Parameter columns, and for CSV (where every cell is a string) the type to read the cell as.
_PARAM_COLUMNS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int, "n": int}


def check_columns(names: list[str]) -> list[str]:
    """Whole-table problems with the header; any of them means no row is read."""
    if not any(name in TABLE_COLUMNS for name in names):
        # Most likely the header line is missing and this is the first item: say that, not "unknown column".
        shown = ", ".join(show(name, 30) for name in names[:4])
        return [f"the first line must be a header naming the columns, such as id,text; it holds {shown}"]
    reasons = []
    for i, name in enumerate(names, start=1):
        if not name:
            reasons.append(f"column {i} has no name; name it or remove it")
    duplicated = sorted({name for name in names if name and names.count(name) > 1})
    if duplicated:
        reasons.append(f"column(s) {', '.join(duplicated)} appear more than once")
    unknown = [name for name in names if name and name not in TABLE_COLUMNS]
    if unknown:
        reasons.append(unknown_names("column(s)", unknown, TABLE_COLUMNS))
    if "id" in names and "custom_id" in names:
        reasons.append("give an id column or a custom_id column, not both")
    elif "id" not in names and "custom_id" not in names:
        reasons.append("no id column: add an id (or custom_id) column so each result can be found in the output")
    if "text" not in names and "prompt" not in names:
        reasons.append("no content column: add a text column (the document) or a prompt column (--task generate)")
    return reasons


def _read_cell(name: str, cell: str) -> object:
    """A CSV cell as the value the column holds: numbers for parameter columns when the cell parses."""
    kind = _PARAM_COLUMNS.get(name)
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


def id_column(names: list[str]) -> str:
    """The table's id column, once check_columns has found exactly one."""
    return "custom_id" if "custom_id" in names else "id"


def row_outcome(values: dict[str, object], id_key: str, task: str, source: str, outcome: ItemOutcome) -> ItemOutcome:
    """Check one row, given its non-missing values by column name; fills and returns outcome."""
    custom_id, id_reasons = check_id(values.get(id_key), id_key)
    given = {name: (name, values[name]) for name in _PARAM_COLUMNS if name in values}
    params, param_reasons = check_params(given)
    content = {"text": values.get("text"), "prompt": values.get("prompt")}
    record, content_reasons = make_record(task, custom_id, content, params, source, outcome.line)
    reasons = id_reasons + content_reasons + param_reasons
    outcome.custom_id, outcome.record = custom_id, record
    return outcome.refuse(reasons)
