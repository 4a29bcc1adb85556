"""`layerbus submit`: read and check an input, render every prompt with the model's chat template, queue a job
(streamed: a million-line input is read and stored a chunk at a time)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import add_job_options, command_parser, open_store, resolve_model

if TYPE_CHECKING:
    from layerbus.jobs.document_split import LongDocuments
    from layerbus.jobs.tasks import TaskSpec
    from layerbus.storage import JobStore


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "submit", main, help="queue a job (prints its id)",
                        description="Check INPUT, render its prompts and queue a job. Prints the job id "
                                    "on stdout; run it with `layerbus broker` or `layerbus run --job`.") as parser:
        parser.add_argument("input", metavar="INPUT", help=".jsonl/.json, .csv, .tsv, .parquet, .arrow, a folder "
                                                           "HF datasets saved, or a folder of .txt files")
        add_job_options(parser)


def main(args: argparse.Namespace) -> int:
    with open_store(args.db) as store:
        job_id = submit_job(store, args)
    print(job_id)
    return EXIT_OK


def submit_job(store: JobStore, args: argparse.Namespace, check_model: Callable[[Path], object] | None = None) -> str:
    """Queue the job that args describe and return its id; nothing is queued when anything is wrong.
    `check_model(model_dir)`: raises when the job's model cannot run where it is meant to (`run`'s stages).

    The input is read, checked, rendered and stored a chunk at a time (jobs/intake.py), so memory does not
    grow with it; the job stays validating (never claimed) until the whole input passed.
    """
    from layerbus.jobs.columns import column_options
    from layerbus.jobs.inputs import FirstIds, input_problem, stream_outcomes
    from layerbus.jobs.intake import ItemsRefused, JobIntake, item_preparer
    from layerbus.jobs.records import InputError

    if args.task is None:
        raise UsageError("--task is required with an INPUT: choose --task summarize, translate or generate")
    spec = _task_spec(args)
    path = Path(args.input)
    unreadable = input_problem(path)
    if unreadable is not None:  # before choosing a model: the default one may need preparing first
        raise InputError([unreadable], valid_count=0)
    model_dir = _job_model(args.model, path)
    if check_model is not None:
        check_model(model_dir)
    from layerbus.jobs.document_split import EXTRA_KEY, DocumentSplitter, token_counter
    from layerbus.jobs.prompts import PromptRenderer
    from layerbus.models.chat_template import read_chat_template
    from layerbus.models.model_files import check_model_dir
    from layerbus.models.model_info import load_tokenizer
    from layerbus.models.model_names import names_of
    from layerbus.storage import JobSettings

    check_model_dir(model_dir)  # ModelDirError names what is wrong with the directory
    # The chat template alone renders the prompts; transformers' tokenizer (and with it torch, seconds
    # to import) only where the template needs it.
    tokenizer = read_chat_template(model_dir)
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(model_dir)
        except ValueError as error:
            raise UsageError(str(error)) from None
    renderer, names = PromptRenderer(spec, tokenizer), names_of(model_dir, args.model)
    long_documents = _long_documents(args, spec.task, model_dir)
    extra = _job_extra(args) | ({} if long_documents is None else {EXTRA_KEY: long_documents.to_extra()})
    settings = JobSettings(task=spec.task, model=str(model_dir), max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=args.seed, target_language=spec.target_language,
                           name=args.name, input_path=str(path.absolute()), extra=extra)
    splitter = None if long_documents is None else DocumentSplitter(
        long_documents, spec.task, renderer, args.max_new_tokens, token_counter(model_dir))
    ids, prepare = FirstIds(), item_preparer(renderer, model_dir, names, splitter)
    intake = JobIntake(store, settings, ids, args.skip_invalid, str(path))
    found = stream_outcomes(path, spec.task, ids, column_options(args))
    intake.add_all(found, prepare)  # interrupted or broken: nothing stays behind
    try:
        job_id = intake.finish()
    except ItemsRefused as refused:
        raise UsageError("\n".join(refused.problems + [
            f"Fix the {len(refused.problems)} problem(s) above, or pass --skip-invalid to record those items as "
            "failed."])) from None
    invalid = intake.invalid_count
    refused_text = f", {invalid} invalid recorded as failed" if invalid else ""
    if splitter is not None and splitter.split_documents:
        refused_text += (f", {splitter.split_documents} long document(s) split into {splitter.parts} part(s) "
                         f"({args.long_documents or 'split'})")
    print(f"layerbus: queued {job_id}: {intake.queued} item(s){refused_text}, model {model_dir}, store {store.url}",
          file=sys.stderr)
    return job_id


def _job_extra(args: argparse.Namespace) -> dict:
    """Settings beyond JobSettings' fields: samples per item (--n, kept only when not 1, so a job without it is
    stored as before) and the job-wide output constraint, checked by compiling it."""
    extra = {"n": args.n} if getattr(args, "n", 1) != 1 else {}
    given = [getattr(args, name, None) for name in ("json_schema", "regex", "choices")]
    if all(value is None for value in given):
        return extra
    from layerbus.jobs.constraints import CONSTRAINT_KEY, job_constraint

    try:
        return {**extra, CONSTRAINT_KEY: job_constraint(*given)}
    except ValueError as error:
        raise UsageError(str(error)) from None


def _job_model(given: str | None, path: Path) -> Path:
    """--model as given; without it, the model every line names when they all name the same one and
    it is found (a model directory's path, or a prepared or imported model's name); else the default."""
    from layerbus.jobs.inputs import named_models
    from layerbus.models.model_names import find_named_model

    named = set() if given else named_models(path)
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


def _long_documents(args: argparse.Namespace, task: str, model_dir: Path) -> LongDocuments | None:
    """How the job treats documents that do not fit (None: as they are, failing at run time); refuses the
    long-document options for generate, whose prompts are sent as they are."""
    from layerbus.jobs.document_split import LongDocuments, model_context
    from layerbus.jobs.long_documents import REDUCE_TEMPLATE

    mode = getattr(args, "long_documents", None)
    if task == "generate":
        given = [option for option, value in (("--long-documents", mode), ("--max-chunk-tokens", args.max_chunk_tokens),
                                              ("--map-template", args.map_template),
                                              ("--reduce-template", args.reduce_template)) if value is not None]
        if given and mode != "fail":
            raise UsageError(f"{', '.join(given)}: a generate prompt is sent as it is, never split or cut; for "
                             "documents longer than the context use --task summarize or --task translate (with "
                             "--long-documents split or truncate), or pass --long-documents fail")
        return None
    if mode == "fail":
        return None
    reduce_template = _template(args.reduce_template, "--reduce-template", "{summaries}",
                                "the summaries of the pieces") or REDUCE_TEMPLATE
    map_template = _template(args.map_template, "--map-template", "{document}", "each piece's text")
    context = min(model_context(model_dir), getattr(args, "max_context", None) or 2048)
    return LongDocuments(mode or "split", context, args.max_chunk_tokens, args.chunk_overlap_tokens, reduce_template,
                         map_template)


def _template(path: str | None, option: str, marker: str, what: str) -> str | None:
    """A template file's text, checked to hold its marker; None when not given."""
    if path is None:
        return None
    try:
        template = Path(path).read_text()
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot read it: {error.strerror}") from None
    if marker not in template:
        raise UsageError(f"{option} {path}: it has no {marker}: write {marker} in it, to mark the place of {what}")
    return template


def _task_spec(args: argparse.Namespace) -> TaskSpec:
    from layerbus.jobs.tasks import TaskSpec

    try:
        return TaskSpec(args.task, args.target_language)
    except ValueError as error:
        raise UsageError(str(error)) from None
