"""Eval documents become job items that ask the model exactly what lm-evaluation-harness asks it.

Hand-computed cases use the tiny test tokenizer (its ids are fixed by its training text: "The stage" is
[305, 352], " receives" [383, 295, 307, 268], BOS 1, EOS 2); random cases check the segments against
encoding.model_input, and one end-to-end case scores the segments on a tiny model as the runtime will and
compares with lm-eval's HFLM on the same requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from layerbus.evals.documents import (
    GENERATION,
    LOGLIKELIHOOD,
    MULTIPLE_CHOICE,
    ROLLING,
    GenerationDoc,
    LoglikelihoodDoc,
    MultipleChoiceDoc,
    RollingDoc,
    TaskFileError,
)
from layerbus.evals.encoding import Encoder, model_input
from layerbus.evals.items import (
    MODEL_KEYS,
    continuations,
    custom_id,
    doc_id_of,
    prompt_hash,
    task_items,
    truncated_pair,
)
from layerbus.evals.suites import LoadedTask
from tests.helpers.tiny_models import make_tiny_tokenizer

TOKENIZER = make_tiny_tokenizer()
ENCODER = Encoder(TOKENIZER)
THE_STAGE, RECEIVES = [305, 352], [383, 295, 307, 268]
A_BATCH, THE_SEA, SPIDER = [264, 297, 293, 73, 78], [267, 309, 71], [328, 338, 269]
BOS, EOS = 1, 2


def loaded(kind: str, docs, name: str = "t", config: dict | None = None) -> LoadedTask:
    return LoadedTask(name, kind, tuple(docs), len(docs), (), 0, 1234, config or {})


def only_item(kind: str, doc, max_length: int = 100, **kwargs):
    (item,) = task_items(loaded(kind, [doc]), ENCODER, max_length, **kwargs)
    return item


# --- the item's fields -------------------------------------------------------------------------------------


def test_an_item_is_keyed_by_task_and_doc_and_carries_the_document():
    doc = LoglikelihoodDoc("q/7", "The stage", " receives", group="g")
    items = task_items(loaded(LOGLIKELIHOOD, [LoglikelihoodDoc("a", "x", "y"), doc], name="lm"), ENCODER, 100,
                       start_seq=10)
    assert [(i.custom_id, i.seq) for i in items] == [("lm/a", 10), ("lm/q/7", 11)]
    assert doc_id_of("lm", items[1].custom_id) == "q/7"  # a "/" in the doc id survives: task names have none
    assert json.loads(items[1].input) == {"id": "q/7", "context": "The stage", "continuation": " receives",
                                          "group": "g"}
    assert items[1].prompt == "The stage"
    assert items[1].params == {"score": [[THE_STAGE, [RECEIVES]]], "eval_task": "lm",
                               "prompt_hash": prompt_hash({"score": [[THE_STAGE, [RECEIVES]]]})}


def test_doc_id_of_refuses_another_tasks_item():
    assert custom_id("a", "1") == "a/1"
    with pytest.raises(ValueError, match="not one of task 'b'"):
        doc_id_of("b", "a/1")


# --- scoring segments, hand-computed ------------------------------------------------------------------------


def test_multiple_choice_is_one_segment_in_choice_order():
    doc = MultipleChoiceDoc("1", "The stage", (" receives", " a batch", " the sea"), (0,))
    assert only_item(MULTIPLE_CHOICE, doc).params["score"] == [[THE_STAGE, [RECEIVES, A_BATCH, THE_SEA]]]


def test_multiple_choice_puts_the_target_delimiter_and_trailing_context_spaces_before_each_choice():
    with_delimiter = MultipleChoiceDoc("1", "The stage", ("receives", "spider"), (0,), target_delimiter=" ")
    trailing_space = MultipleChoiceDoc("1", "The stage ", ("receives", "spider"), (0,))
    for doc in (with_delimiter, trailing_space):
        assert only_item(MULTIPLE_CHOICE, doc).params["score"] == [[THE_STAGE, [RECEIVES, SPIDER]]]


def test_an_empty_context_is_the_prefix_token():
    doc = MultipleChoiceDoc("1", "", (" receives", " spider"), (0,))
    assert only_item(MULTIPLE_CHOICE, doc).params["score"] == [[[BOS], [RECEIVES, SPIDER]]]


def test_truncation_gives_choices_of_other_lengths_their_own_segment_keeping_choice_order():
    """max_length 4: " receives" (4 tokens) keeps only "stage" of the context; the 3-token choices keep both."""
    doc = MultipleChoiceDoc("1", "The stage", (" the sea", " receives", " spider"), (0,))
    segments = only_item(MULTIPLE_CHOICE, doc, max_length=4).params["score"]
    assert segments == [[THE_STAGE, [THE_SEA]], [[352], [RECEIVES]], [THE_STAGE, [SPIDER]]]
    assert continuations(segments) == [THE_SEA, RECEIVES, SPIDER]


def test_truncated_pair_keeps_max_length_plus_one_tokens():
    assert truncated_pair([1, 2, 3, 4, 5], [6, 7], 4) == ([3, 4, 5], [6, 7])
    assert truncated_pair([1, 2], [6, 7], 4) == ([1, 2], [6, 7])
    assert truncated_pair([1, 2, 3], [6, 7], 2) == ([3], [6, 7])  # the continuation fills the window


def test_a_context_of_only_whitespace_is_refused_with_the_way_out():
    doc = MultipleChoiceDoc("ws", "  ", (" receives", " spider"), (0,))
    with pytest.raises(TaskFileError, match="document 'ws': the context is only whitespace.*make the context empty"):
        only_item(MULTIPLE_CHOICE, doc)
    with pytest.raises(ValueError, match="only whitespace"):
        truncated_pair([], [1], 4)


def test_a_continuation_longer_than_max_length_refuses_the_task_naming_the_document():
    docs = [LoglikelihoodDoc("ok", "The stage", " the sea"), LoglikelihoodDoc("long", "The stage", " receives"),
            LoglikelihoodDoc("longer", "x", " receives receives")]
    with pytest.raises(TaskFileError) as caught:
        task_items(loaded(LOGLIKELIHOOD, docs, name="lm"), ENCODER, 3)
    messages = [str(p) for p in caught.value.problems]
    assert len(messages) == 2
    assert messages[0].startswith("lm: document 'long': the continuation is 4 tokens, more than max_length 3")
    assert "raise max_length or shorten the document" in messages[0]
    assert messages[1].startswith("lm: document 'longer': ")
    assert "nothing was queued" in str(caught.value)


def test_loglikelihood_at_exactly_max_length_keeps_one_context_token():
    item = only_item(LOGLIKELIHOOD, LoglikelihoodDoc("1", "The stage", " receives"), max_length=4)
    assert item.params["score"] == [[[352], [RECEIVES]]]


def test_rolling_windows_hand_computed():
    """"The stage receives" is 6 tokens; max_length 4: [BOS] -> first 4 tokens, then 3 tokens -> the last 2."""
    item = only_item(ROLLING, RollingDoc("1", "The stage receives"), max_length=4)
    assert item.params["score"] == [[[BOS], [[305, 352, 383, 295]]], [[352, 383, 295], [[307, 268]]]]
    assert item.prompt == "The stage receives"


# --- scoring segments, against lm-eval's truncation -----------------------------------------------------------

PIECES = ["The", " stage", " receives", " a", " batch", " of", " the", " sea", ".", "\n", " 42", "é", "  "]


def random_text(rng: random.Random, most: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, most)))


def random_context(rng: random.Random, most: int) -> str:
    """Text with something besides whitespace (a context of whitespace alone is refused, by lm-eval too)."""
    while not (text := random_text(rng, most)).strip():
        pass
    return text


@pytest.mark.parametrize("seed", range(8))
def test_every_scored_position_is_one_lm_eval_scores(seed):
    """The runtime runs context + continuation[:-1] and reads the continuation's positions: that must be
    model_input(context, continuation) with the same continuation, for every choice in choice order."""
    rng = random.Random(seed)
    docs = []
    for n in range(30):
        choices = tuple(dict.fromkeys(random_text(rng, 2) for _ in range(rng.randint(2, 5))))
        context = "" if n % 7 == 0 else random_context(rng, 12)
        if len(choices) > 1:
            docs.append(MultipleChoiceDoc(str(n), context, choices, (0,), target_delimiter=rng.choice(["", " "])))
    max_length = rng.randint(12, 16)
    items = task_items(loaded(MULTIPLE_CHOICE, docs), ENCODER, max_length)
    truncated = 0
    for doc, item in zip(docs, items):
        segments = item.params["score"]
        flat = [(context, k) for context, conts in segments for k in conts]
        assert len(flat) == len(doc.choices)
        for (context, k), choice in zip(flat, doc.choices):
            lm_context, lm_continuation = ENCODER.encode_pair(doc.context, doc.target_delimiter + choice)
            assert k == lm_continuation
            assert context and context + k[:-1] == model_input(lm_context, lm_continuation, max_length)
            truncated += len(lm_context) + len(lm_continuation) > max_length + 1
        # Runs: consecutive segments never share a context (they would have been one segment).
        assert all(a[0] != b[0] for a, b in zip(segments, segments[1:]))
    assert truncated >= 5, "the cases must exercise left truncation"


@pytest.mark.parametrize("seed", range(6))
def test_rolling_windows_cover_every_token_once(seed):
    rng = random.Random(seed)
    text, max_length = random_text(rng, 40), rng.randint(1, 12)
    segments = only_item(ROLLING, RollingDoc("1", text), max_length=max_length).params["score"]
    flat = [token for k in continuations(segments) for token in k]
    assert flat == ENCODER.tok_encode(text)
    assert all(len(conts) == 1 and context for context, conts in segments)
    assert all(len(context) + len(conts[0]) - 1 <= max_length for context, conts in segments)
    assert segments[0][0] == [BOS]


# --- generation -------------------------------------------------------------------------------------------


def gen_doc(**fields) -> GenerationDoc:
    return GenerationDoc(**{"id": "g", "prompt": "The stage", "messages": None, "targets": ("x",), **fields})


def test_generation_asks_greedy_with_lm_evals_defaults():
    item = only_item(GENERATION, gen_doc(until=("\n",)), max_length=300)
    assert item.prompt == "The stage"
    assert {k: item.params[k] for k in ("prompt_ids", "max_tokens", "stop", "temperature")} == \
        {"prompt_ids": THE_STAGE, "max_tokens": 256, "stop": ["\n", "<|eos|>"], "temperature": 0}
    assert item.params["prompt_hash"] == prompt_hash(item.params)


def test_generation_left_truncates_the_prompt_to_leave_room_for_max_gen_toks():
    item = only_item(GENERATION, gen_doc(max_gen_toks=10), max_length=11)
    assert (item.params["prompt_ids"], item.params["max_tokens"]) == ([352], 10)
    with pytest.raises(TaskFileError, match="document 'g': max_gen_toks 10 leaves no room for the prompt in "
                                            "max_length 10"):
        only_item(GENERATION, gen_doc(max_gen_toks=10), max_length=10)


def test_generation_default_max_gen_toks_can_be_the_runs():
    assert only_item(GENERATION, gen_doc(), max_length=300, default_max_gen_toks=5).params["max_tokens"] == 5


def test_chat_messages_go_through_the_chat_template_and_are_not_given_a_second_bos():
    item = only_item(GENERATION, gen_doc(prompt=None, messages=({"role": "user", "content": "x"},)), max_length=300)
    assert item.prompt == "<|bos|><|user|>\nx<|eos|>\n<|assistant|>\n"
    assert item.params["prompt_ids"] == [BOS, 5, 205, 94, EOS, 205, 6, 205]


def test_a_stop_list_that_has_the_eos_already_keeps_it_once():
    assert only_item(GENERATION, gen_doc(until=("<|eos|>", "Q:")), max_length=300).params["stop"] == ["<|eos|>", "Q:"]


@pytest.mark.parametrize("kwargs", [{"do_sample": True}, {"temperature": 0.7}])
def test_a_task_asking_for_sampling_is_refused(kwargs):
    task = loaded(GENERATION, [gen_doc()], config={"generation_kwargs": kwargs})
    with pytest.raises(TaskFileError, match="eval items are greedy: set do_sample: false"):
        task_items(task, ENCODER, 300)


def test_greedy_generation_kwargs_are_accepted():
    task = loaded(GENERATION, [gen_doc()], config={"generation_kwargs": {"do_sample": False, "temperature": 0.7}})
    assert len(task_items(task, ENCODER, 300)) == 1


# --- the prompt hash ----------------------------------------------------------------------------------------

MC_DOCS = [MultipleChoiceDoc("1", "The stage", (" receives", " a batch"), (0,)),
           MultipleChoiceDoc("2", "The stage", (" the sea", " spider"), (1,))]


def hashes(task: LoadedTask, max_length: int = 100) -> list[str]:
    return [item.params["prompt_hash"] for item in task_items(task, ENCODER, max_length)]


def test_the_prompt_hash_changes_with_a_continuation_and_only_that_document():
    base = hashes(loaded(MULTIPLE_CHOICE, MC_DOCS))
    changed = hashes(loaded(MULTIPLE_CHOICE, [MC_DOCS[0], replace(MC_DOCS[1], choices=(" the sea", " receives"))]))
    assert base[0] == changed[0] and base[1] != changed[1]
    assert len(set(base)) == 2


def test_the_prompt_hash_ignores_what_the_model_is_not_asked():
    base = hashes(loaded(MULTIPLE_CHOICE, MC_DOCS))
    renamed = [replace(d, id=d.id + "x", gold=(1,), group="g") for d in MC_DOCS]
    assert hashes(loaded(MULTIPLE_CHOICE, renamed, name="other")) == base
    assert hashes(loaded(MULTIPLE_CHOICE, MC_DOCS), max_length=50) == base  # no truncation either way
    assert hashes(loaded(MULTIPLE_CHOICE, MC_DOCS), max_length=5) != base  # truncation changes what is asked


def test_the_prompt_hash_covers_stop_strings_and_max_tokens():
    def hash_of(doc: GenerationDoc, max_length: int = 300) -> str:
        return only_item(GENERATION, doc, max_length=max_length).params["prompt_hash"]

    base = hash_of(gen_doc())
    assert hash_of(gen_doc(until=("\n",))) != base
    assert hash_of(gen_doc(max_gen_toks=5)) != base
    assert hash_of(gen_doc(targets=("y",), id="other")) == base
    assert hash_of(gen_doc(), max_length=400) == base and hash_of(gen_doc(), max_length=257) != base


def test_prompt_hash_is_the_sha256_of_the_canonical_json():
    import hashlib

    params = {"stop": ["é"], "prompt_ids": [1, 2], "max_tokens": 3, "eval_task": "ignored"}
    canonical = '{"max_tokens":3,"prompt_ids":[1,2],"stop":["é"]}'
    assert prompt_hash(params) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert set(MODEL_KEYS) == {"score", "prompt_ids", "max_tokens", "stop"}
    with pytest.raises(ValueError, match="nothing is asked"):
        prompt_hash({"eval_task": "t"})


# --- end to end: the runtime's scoring of the segments equals HFLM's --------------------------------------------


def score_segments(model, segments) -> list[tuple[float, bool]]:
    """What the runtime does with a scoring item: run context + continuation[:-1], read the continuation's positions."""
    import torch

    out = []
    for context, conts in segments:
        for k in conts:
            with torch.no_grad():
                logits = model(torch.tensor([context + k[:-1]])).logits[0, len(context) - 1:]  # [len(k), vocab]
            logprobs = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(k)
            out.append((logprobs.gather(1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())))
    return out


def test_scoring_the_segments_gives_hflms_loglikelihoods(tiny_models):
    pytest.importorskip("lm_eval")
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, max_length = tiny_models("llama"), 12
    lm = HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=4, max_length=max_length)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoder = Encoder(AutoTokenizer.from_pretrained(model_dir))
    rng = random.Random(5)
    mc = [MultipleChoiceDoc(str(n), "" if n == 0 else random_context(rng, 10),
                            tuple(dict.fromkeys([" stage", " sea", *(random_text(rng, 2) for _ in range(2))])), (0,),
                            target_delimiter="") for n in range(8)]
    requests = [Instance("loglikelihood", {}, (d.context, c), i) for i, (d, c) in
                enumerate((d, c) for d in mc for c in d.choices)]
    expected = lm.loglikelihood(requests, disable_tqdm=True)
    got = [pair for item in task_items(loaded(MULTIPLE_CHOICE, mc), encoder, max_length)
           for pair in score_segments(model, item.params["score"])]
    assert [g for _, g in got] == [g for _, g in expected]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=1e-4)

    texts = [random_text(rng, 30) for _ in range(3)]
    expected_rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i)
                                                 for i, t in enumerate(texts)], disable_tqdm=True)
    items = task_items(loaded(ROLLING, [RollingDoc(str(i), t) for i, t in enumerate(texts)]), encoder, max_length)
    got_rolling = [sum(ll for ll, _ in score_segments(model, item.params["score"])) for item in items]
    assert got_rolling == pytest.approx(expected_rolling, abs=1e-4)
    assert any(len(item.params["score"]) > 1 for item in items), "the texts must take several windows"


def test_the_bundled_suite_becomes_one_jobs_items():
    """Every task of examples/evals/nightly.toml can be asked; seq runs on across tasks, custom ids never repeat."""
    from pathlib import Path

    from layerbus.evals.suites import load_suite, load_suite_tasks

    suite = Path(__file__).resolve().parents[2] / "examples" / "evals" / "nightly.toml"
    items, start = [], 0
    for task in load_suite_tasks(load_suite(suite)):
        task_list = task_items(task, ENCODER, 2048, start_seq=start)
        assert len(task_list) == len(task.docs) and {i.params["eval_task"] for i in task_list} == {task.name}
        items += task_list
        start += len(task_list)
    assert [i.seq for i in items] == list(range(len(items)))
    assert len({i.custom_id for i in items}) == len(items)
    assert all(i.params["prompt_hash"] == prompt_hash(i.params) for i in items)
