"""An eval task's documents as job items: what the model is asked for each document, in the eval runtime's contract.

One item per document, custom_id "<task>/<doc id>" (task names have no "/", so the first one splits them), input
the document's fields as JSON, seq counting up from start_seq in document order. params holds what the model
is asked, the task's name and the prompt hash:

- Scoring (multiple choice, log-likelihood, rolling): params["score"] is a list of SEGMENTS
  [context_ids, [continuation_ids, ...]]: a context (>= 1 token) prefilled once, and continuations (>= 1 token
  each) each scored after it. The runtime answers {"ll": [...], "is_greedy": [...], "tokens": [...]}, one entry
  per continuation, segments flattened in order.
  - multiple choice: the ids lm-eval scores for context + target_delimiter + choice (Encoder.encode_pair),
    one segment per run of consecutive choices whose (truncated) context ids are equal. Usually that is one
    segment for all choices; runs (not groups) keep the flattened order the choice order, so no index map
    is needed even when a merge or truncation gives one choice a context of its own.
  - log-likelihood: one segment, one continuation.
  - rolling: one segment per window of Encoder.rolling_windows; the document's ll is their sum.
  lm-eval runs (context + continuation)[-(max_length + 1):][:-1] (encoding.model_input) and reads the
  continuation's positions from the end. The same positions as a segment: whole = (context + continuation)
  [-(max_length + 1):], context = whole minus the continuation at its end. That context is never empty while
  the continuation has at most max_length tokens; a longer one cannot be scored whole (lm-eval's slice would
  read positions that are not there), so such a document is refused.
- Generation: params["prompt_ids"] are HFLM.generate_until's (Encoder.generation_ids of the prompt text, or of
  the chat template's text for messages) left-truncated to max_length - max_tokens; max_tokens is the
  document's max_gen_toks (a YAML's generation_kwargs reach the documents) or 256, lm-eval's default; stop is
  the document's until plus the decoded EOS (handle_stop_sequences); temperature 0 (greedy).

prompt_hash is the first 16 hex digits of the SHA-256 of the canonical JSON of what the model is asked (the
segments, or prompt ids + max_tokens + stop): two runs asked the same thing exactly when their hashes agree.

A document that cannot be asked refuses the whole task (TaskFileError, every document's problem at once):
an eval scored on the documents that happened to fit would not be comparable with the next run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from layerbus.evals.documents import (
    GENERATION,
    LOGLIKELIHOOD,
    MULTIPLE_CHOICE,
    ROLLING,
    Document,
    GenerationDoc,
    LoglikelihoodDoc,
    MultipleChoiceDoc,
    RollingDoc,
    TaskFileError,
    TaskProblem,
)
from layerbus.evals.encoding import Encoder
from layerbus.evals.suites import LoadedTask
from layerbus.evals.yaml_docs import DEFAULT_MAX_GEN_TOKS
from layerbus.storage.records import NewItem

# The params keys that say what the model is asked; prompt_hash covers exactly these.
MODEL_KEYS = ("score", "prompt_ids", "max_tokens", "stop")
# Hex digits of the SHA-256 kept: 64 bits, far beyond any collision a suite's documents could meet.
HASH_DIGITS = 16

# [context ids, [continuation ids, ...]], as lists so params compare equal after a JSON round trip.
Segment = list


def custom_id(task: str, doc_id: str) -> str:
    """The item's key in the job: the task's name, "/", the document's id."""
    return f"{task}/{doc_id}"


def doc_id_of(task: str, item_custom_id: str) -> str:
    """The document id in an item's custom_id; raises ValueError when the item is not one of the task's."""
    prefix = f"{task}/"
    if not item_custom_id.startswith(prefix):
        raise ValueError(f"item {item_custom_id!r} is not one of task {task!r}'s (their ids start with {prefix!r})")
    return item_custom_id[len(prefix):]


def prompt_hash(params: dict) -> str:
    """SHA-256 (first 16 hex digits) of the canonical JSON of what an item asks the model (MODEL_KEYS in params)."""
    asked = {key: params[key] for key in MODEL_KEYS if key in params}
    if not asked:
        raise ValueError(f"params {sorted(params)} hold none of {', '.join(MODEL_KEYS)}: nothing is asked to hash")
    canonical = json.dumps(asked, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HASH_DIGITS]


def truncated_pair(context_ids: list[int], continuation_ids: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """The (context, continuation) whose scoring reads exactly the positions lm-eval's truncated input gives.

    Raises ValueError when the continuation is longer than max_length (model_input refuses it too).
    """
    if not continuation_ids:
        raise ValueError("the continuation encodes to no tokens: there is nothing to score")
    if not context_ids:
        # encode_pair moves a context's trailing whitespace onto the continuation, as lm-eval does; a context of
        # only whitespace is left with no token to condition on, and lm-eval's HF backend asserts on it.
        raise ValueError("the context is only whitespace, which moves onto the continuation and leaves no context "
                         "token: make the context empty (the prefix token then stands in) or give it text")
    if len(continuation_ids) > max_length:
        raise ValueError(f"the continuation is {len(continuation_ids)} tokens, more than max_length {max_length}: "
                         "lm-eval cannot score it whole either; raise max_length or shorten the document")
    whole = (context_ids + continuation_ids)[-(max_length + 1):]
    return whole[: len(whole) - len(continuation_ids)], list(continuation_ids)


def continuations(segments: list[Segment]) -> list[list[int]]:
    """Every continuation of the segments, in the order the runtime answers them."""
    return [continuation for _, conts in segments for continuation in conts]


def multiple_choice_segments(doc: MultipleChoiceDoc, encoder: Encoder, max_length: int) -> list[Segment]:
    """One segment per run of consecutive choices with equal (truncated) context ids; flattened, the choice order."""
    segments: list[Segment] = []
    for choice in doc.choices:
        context_ids, choice_ids = truncated_pair(*encoder.encode_pair(doc.context, doc.target_delimiter + choice),
                                                 max_length)
        if segments and segments[-1][0] == context_ids:
            segments[-1][1].append(choice_ids)
        else:
            segments.append([context_ids, [choice_ids]])
    return segments


def loglikelihood_segments(doc: LoglikelihoodDoc, encoder: Encoder, max_length: int) -> list[Segment]:
    context_ids, continuation_ids = truncated_pair(*encoder.encode_pair(doc.context, doc.continuation), max_length)
    return [[context_ids, [continuation_ids]]]


def rolling_segments(doc: RollingDoc, encoder: Encoder, max_length: int) -> list[Segment]:
    """One segment per rolling window; together their continuations are every token of the text, once."""
    windows = encoder.rolling_windows(doc.text, max_length)
    if not windows:
        raise ValueError("the text encodes to no tokens: there is nothing to score")
    # The windows never need truncating (each is at most max_length + 1 tokens); truncated_pair checks it all the same.
    return [[list(c), [list(k)]] for c, k in (truncated_pair(c, k, max_length) for c, k in windows)]


SEGMENT_BUILDERS = {MULTIPLE_CHOICE: multiple_choice_segments, LOGLIKELIHOOD: loglikelihood_segments,
                    ROLLING: rolling_segments}


def generation_params(doc: GenerationDoc, encoder: Encoder, max_length: int,
                      default_max_gen_toks: int = DEFAULT_MAX_GEN_TOKS) -> tuple[str, dict]:
    """(prompt text, the params asking the model) of a generation document, as HFLM.generate_until asks."""
    max_tokens = doc.max_gen_toks if doc.max_gen_toks is not None else default_max_gen_toks
    room = max_length - max_tokens
    if room < 1:
        raise ValueError(f"max_gen_toks {max_tokens} leaves no room for the prompt in max_length {max_length} "
                         "(lm-eval asserts the same): lower max_gen_toks or raise max_length")
    text = doc.prompt if doc.prompt is not None else encoder.chat_text(doc.messages)
    params = {"prompt_ids": encoder.generation_ids(text, room), "max_tokens": max_tokens,
              "stop": encoder.stop_strings(doc.until), "temperature": 0}
    return text, params


def _scoring_prompt(doc: Document) -> str:
    """The text a person reads for a scoring item: the context (a rolling document's own text)."""
    return doc.text if isinstance(doc, RollingDoc) else doc.context


def _sampling_problem(task: LoadedTask) -> str | None:
    """Why the task's generation_kwargs ask for sampling, which the runtime's greedy items would not honour."""
    kwargs = task.config.get("generation_kwargs") or {}
    temperature = kwargs.get("temperature", 0.0)
    sampled = kwargs.get("do_sample") if kwargs.get("do_sample") is not None else \
        (isinstance(temperature, (int, float)) and temperature > 0)
    if not sampled:
        return None
    return (f"generation_kwargs ask for sampling (do_sample {kwargs.get('do_sample')!r}, temperature {temperature!r}); "
            "eval items are greedy: set do_sample: false (or temperature: 0) in the task YAML")


def task_items(task: LoadedTask, encoder: Encoder, max_length: int, start_seq: int = 0,
               default_max_gen_toks: int = DEFAULT_MAX_GEN_TOKS) -> list[NewItem]:
    """One item per document of the task, seq start_seq, start_seq + 1, ... in document order.

    max_length is the model's context in tokens (lm-eval's max_length). Raises TaskFileError naming every
    document that cannot be asked, and nothing is returned for any of them.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be a positive number of tokens, got {max_length}")
    problems: list[TaskProblem] = []
    if task.kind == GENERATION and (problem := _sampling_problem(task)) is not None:
        problems.append(TaskProblem(task.name, 0, problem))
    items = []
    for position, doc in enumerate(task.docs):
        try:
            if task.kind == GENERATION:
                prompt, params = generation_params(doc, encoder, max_length, default_max_gen_toks)
            else:
                prompt, params = _scoring_prompt(doc), {"score": SEGMENT_BUILDERS[task.kind](doc, encoder, max_length)}
        except ValueError as e:  # encoding refusals and transformers' own (a tokenizer without a chat template)
            problems.append(TaskProblem(task.name, 0, f"document {doc.id!r}: {e}"))
            continue
        params = {**params, "eval_task": task.name, "prompt_hash": prompt_hash(params)}
        items.append(NewItem(custom_id=custom_id(task.name, doc.id), input=json.dumps(asdict(doc), ensure_ascii=False),
                             prompt=prompt, params=params, seq=start_seq + position))
    if problems:
        raise TaskFileError(problems)
    return items
