"""A batch's input file validated into a layerbus job, as `layerbus submit --task generate` queues one: every
line read, checked and its prompt rendered with the model's chat template, a chunk at a time (jobs/intake.py).
A file with bad lines queues nothing: the batch fails with one entry of errors.data per line, naming it.

A batch runs one model, the one its lines' body.model names: a model directory the server was started with
(`layerbus serve --model DIR`, named by its path or its directory's name) or a prepared model (by name). Brokers of
that model then pick the job up as they pick up any queued job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerbus.storage.store import JobStore

LOG = logging.getLogger(__name__)
# The most entries of errors.data; the last then says how many more lines were refused.
MAX_ERRORS = 100


class BatchRefused(Exception):
    """A batch input that cannot run: OpenAI's errors.data entries, each naming its line where there is one."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(error["message"] for error in errors))
        self.errors = errors


def error_entry(message: str, line: int | None = None, code: str = "invalid_request",
                param: str | None = None) -> dict[str, Any]:
    return {"code": code, "line": line, "message": message, "param": param}


def batch_model(names: set[str], models: Sequence[Path]) -> Path:
    """The model directory the lines' body.model names: one the server was given (its path or directory name), or
    a prepared model's name. Lines naming other models are refused each by its line, as submit refuses them; other
    paths on the server's machine are never read. BatchRefused when no named model, or several, can run."""
    found = {name: _known_model(name, models) for name in sorted(names)}
    known = {name: path for name, path in found.items() if path is not None}
    if len(known) == 1:
        return next(iter(known.values()))
    given = ", ".join(model.name for model in models) or "none"
    if not names:
        said = "no line names body.model"
    elif not known:
        said = f"body.model {', '.join(map(repr, sorted(names)))} is not a model this server runs"
    else:
        said = f"the lines name {len(known)} models this server runs ({', '.join(sorted(known))})"
    raise BatchRefused([error_entry(
        f"{said}: a batch runs one model; name in every line's body.model a model the server was started with "
        f"(`layerbus serve --model DIR`; given: {given}) or a prepared model (`layerbus model`)",
        code="model_not_found", param="body.model")])


def _known_model(name: str, models: Sequence[Path]) -> Path | None:
    from layerbus.models.model_names import find_named_model

    for model in models:
        if name in (str(model), model.name):
            return model
    return find_named_model(name, progress=LOG.info) if "/" not in name else None


def submit_batch_job(store: JobStore, path: Path, endpoint: str, batch_id: str, models: Sequence[Path]) -> str:
    """Queue the batch input at `path` as a job named `batch_id`; its id, or BatchRefused (nothing stays queued)."""
    from layerbus.jobs.inputs import FirstIds, named_models, stream_outcomes
    from layerbus.jobs.intake import ItemsRefused, JobIntake, item_preparer
    from layerbus.jobs.prompts import PromptRenderer
    from layerbus.jobs.records import InputError
    from layerbus.jobs.tasks import TaskSpec
    from layerbus.models.chat_template import read_chat_template
    from layerbus.models.model_files import check_model_dir
    from layerbus.models.model_info import load_tokenizer
    from layerbus.models.model_names import names_of
    from layerbus.storage.records import JobSettings

    model_dir = batch_model(named_models(path), models)
    check_model_dir(model_dir)
    tokenizer = read_chat_template(model_dir) or load_tokenizer(model_dir)
    renderer = PromptRenderer(TaskSpec("generate", None), tokenizer)
    settings = JobSettings(task="generate", model=str(model_dir), name=batch_id, input_path=str(path))
    refused: list[dict[str, Any]] = []
    prepare_item = item_preparer(renderer, model_dir, names_of(model_dir, None))

    def prepare(record):  # type: ignore[no-untyped-def]
        prepared = prepare_item(record) if record.endpoint == endpoint else _endpoint_problem(record.endpoint, endpoint)
        if isinstance(prepared, str) and len(refused) <= MAX_ERRORS:
            refused.append(error_entry(prepared, record.line))
        return prepared

    ids = FirstIds()
    intake = JobIntake(store, settings, ids, False, path.name)
    intake.add_all(stream_outcomes(path, "generate", ids), prepare)
    try:
        return intake.finish()
    except InputError as error:
        raise BatchRefused(_capped([error_entry(problem.message, problem.line or None)
                                    for problem in error.problems])) from None
    except ItemsRefused as error:
        raise BatchRefused(_capped(refused, len(error.problems))) from None


def _endpoint_problem(given: str | None, endpoint: str) -> str:
    if given is None:
        return ('not an OpenAI batch request line: each line is {"custom_id", "method": "POST", "url", "body"}; '
                "simple lines go to `layerbus submit`")
    return (f"url {given!r} is not the batch's endpoint {endpoint!r}: a batch's lines all ask for its endpoint; "
            "send the others as a batch of their own")


def _capped(errors: list[dict[str, Any]], total: int | None = None) -> list[dict[str, Any]]:
    total = len(errors) if total is None else total
    if total <= MAX_ERRORS:
        return errors
    return errors[:MAX_ERRORS] + [error_entry(f"and {total - MAX_ERRORS} more lines refused; fix the ones above and "
                                              "create the batch again to see them")]
