"""`layerbus submit`: read and check an input, render every prompt with the model's tokenizer, queue a job."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import add_job_options, add_verbose, open_store, resolve_model

if TYPE_CHECKING:
    from layerbus.jobs.records import InputRecord
    from layerbus.jobs.tasks import TaskSpec
    from layerbus.storage import InvalidItem, JobStore, NewItem


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("submit", help="queue a job (prints its id)",
                                   description="Check INPUT, render its prompts and queue a job. Prints the job id "
                                               "on stdout; run it with `layerbus broker` or `layerbus run --job`.")
    parser.add_argument("input", metavar="INPUT", help=".jsonl/.json, .csv, .parquet, or a folder of .txt files")
    add_job_options(parser)
    add_verbose(parser)
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    with open_store(args.db) as store:
        job_id = submit_job(store, args)
    print(job_id)
    return EXIT_OK


def submit_job(store: JobStore, args: argparse.Namespace, check_model: Callable[[Path], object] | None = None) -> str:
    """Queue the job that args describe and return its id; nothing is queued when anything is wrong.
    `check_model(model_dir)`: raises when the job's model cannot run where it is meant to (`run`'s stages)."""
    from layerbus.jobs.inputs import load_inputs

    if args.task is None:
        raise UsageError("--task is required with an INPUT: choose --task summarize, translate or generate")
    spec = _task_spec(args)
    read = load_inputs(Path(args.input), spec.task, args.skip_invalid)  # InputError lists every problem
    model_dir = _job_model(args.model, read.records)
    if check_model is not None:
        check_model(model_dir)
    from layerbus.models.chat_template import read_chat_template
    from layerbus.models.model_files import check_model_dir
    from layerbus.models.model_info import load_tokenizer
    from layerbus.storage import JobSettings

    check_model_dir(model_dir)  # ModelDirError names what is wrong with the directory
    records, invalid, problems = _same_model(read.records, model_dir, args.model)
    # The chat template alone renders the prompts; transformers' tokenizer (and with it torch, seconds
    # to import) only where the template needs it.
    tokenizer = read_chat_template(model_dir)
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(model_dir)
        except ValueError as error:
            raise UsageError(str(error)) from None
    items, render_invalid, render_problems = _render_items(records, spec, tokenizer)
    invalid, problems = invalid + render_invalid, problems + render_problems
    if problems and not args.skip_invalid:
        raise UsageError("\n".join(problems + [
            f"Fix the {len(problems)} problem(s) above, or pass --skip-invalid to record those items as failed."]))
    invalid += read.invalid
    settings = JobSettings(task=spec.task, model=str(model_dir), max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=args.seed, target_language=spec.target_language,
                           name=args.name, input_path=str(Path(args.input).absolute()))
    job_id = store.create_job(settings, items, invalid)
    refused = f", {len(invalid)} invalid recorded as failed" if invalid else ""
    print(f"layerbus: queued {job_id}: {len(items)} item(s){refused}, model {model_dir}, store {store.url}",
          file=sys.stderr)
    return job_id


def _job_model(given: str | None, records: list[InputRecord]) -> Path:
    """--model as given; without it, the model every line names when they all name the same one and
    it is found (a model directory's path, or a prepared or imported model's name); else the default."""
    from layerbus.models.model_names import find_named_model

    named = {record.model for record in records if record.model is not None}
    if given or len(named) != 1:
        return resolve_model(given)  # lines naming other models are refused below, each by its line
    name = named.pop()
    found = find_named_model(name, progress=lambda message: print(message, file=sys.stderr))
    if found is None:
        raise UsageError(f"every line names the model {name!r}, which is neither a model directory nor a prepared "
                         "model (`layerbus model`): pass --model DIR for the model to run them on, and name that "
                         "model in the lines' body.model (its path, directory name or prepared name)")
    print(f"layerbus: using the model the lines name, {name!r} ({found})", file=sys.stderr)
    return found


def _same_model(records: list[InputRecord], model_dir: Path, given: str | None) -> tuple[
        list[InputRecord], list[InvalidItem], list[str]]:
    """The records for the job's model; those whose line names another model as failed items and
    problem lines (answering them with this model would give them another model's output)."""
    from layerbus.models.model_names import names_of
    from layerbus.storage import InvalidItem

    names = names_of(model_dir, given)
    kept, invalid, problems = [], [], []
    for record in records:
        if record.model is None or record.model in names:
            kept.append(record)
            continue
        error = (f"body.model {record.model!r} is not this job's model ({model_dir.name}, {model_dir}); a job runs one "
                 f"model: give this line the job's model name, or submit the lines for {record.model!r} as their "
                 "own job with --model")
        problems.append(f"{record.source}:{record.line}: {error}")
        invalid.append(InvalidItem(record.custom_id, _input_text(record), error, record.line))
    return kept, invalid, problems


def _task_spec(args: argparse.Namespace) -> TaskSpec:
    from layerbus.jobs.tasks import TaskSpec

    try:
        return TaskSpec(args.task, args.target_language)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _render_items(records: list[InputRecord], spec: TaskSpec, tokenizer: Any) -> tuple[
        list[NewItem], list[InvalidItem], list[str]]:
    """NewItems for the records render_prompt accepts; the others as failed items and problem lines."""
    from layerbus.jobs.item_params import item_params
    from layerbus.jobs.tasks import render_prompt
    from layerbus.storage import InvalidItem, NewItem

    items, invalid, problems = [], [], []
    for record in records:
        try:
            prompt = render_prompt(record, spec, tokenizer)
        except ValueError as error:
            problems.append(f"{record.source}:{record.line}: {error}")
            invalid.append(InvalidItem(record.custom_id, _input_text(record), str(error), record.line))
            continue
        params = item_params(record.params, prompt.add_special_tokens)
        items.append(NewItem(record.custom_id, _input_text(record), prompt.text, params, record.line))
    return items, invalid, problems


def _input_text(record: InputRecord) -> str:
    """The user's input as echoed in the results: the document, the raw prompt, or the messages as JSON."""
    if record.text is not None:
        return record.text
    if record.prompt is not None:
        return record.prompt
    return json.dumps(record.messages, ensure_ascii=False)

