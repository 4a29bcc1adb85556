"""Constrained decoding: a JSON schema, a regex or a choice list per item or per job.

The wire form of the mask and the last stage's use of it, what users give parsed (a constraint the grammar
engine cannot compile is refused at submit with its file:line), and the broker-side path (scheduler, grammar,
mask, the last stage's sampling) without processes, on seeded random logits. tests/cluster/test_constrained.py
runs it through real stage processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from layerbus.broker.grammar import GrammarCompiler
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.scheduler import Scheduler
from layerbus.jobs.constraints import CONSTRAINT_KEY, constraint_of, job_constraint
from layerbus.jobs.jsonl_items import parse_jsonl_line
from layerbus.models.model_info import read_model_info
from layerbus.stages.sampling import allowed_tokens, choose_token
from layerbus.wire.constraint import MASK_KEY, Constraint, pack_mask, unpack_mask
from layerbus.wire.sampling import SamplingParams
from tests.helpers.constrained_items import CHOICES, PERSON, REGEX, check_output, mixed_requests
from tests.helpers.fixtures_cli import tiny  # noqa: F401 - fixture


# ---- the wire form of the mask, and the last stage's use of it ----------------------------------------

def test_a_mask_round_trips_and_masks_exactly_its_tokens():
    allowed = {0, 5, 31, 32, 383}
    bitmask = bytearray(48)  # 384 tokens
    for token in allowed:
        bitmask[token // 8] |= 1 << (token % 8)
    packed = pack_mask(bytes(bitmask))
    assert unpack_mask(packed) == bytes(bitmask)
    mask = allowed_tokens(packed, 390)  # a head wider than the mask: the extra tokens are not allowed
    assert set(torch.nonzero(mask).flatten().tolist()) == allowed
    logits = torch.randn(390)
    logits[7] = 100.0  # the unconstrained argmax, not allowed
    token, _ = choose_token(logits.masked_fill(~mask, float("-inf")), SamplingParams(), 0)
    assert token in allowed


@pytest.mark.parametrize("bad", ["not base64!", "AAAA", 17, pack_mask(b"\x00" * 48)])
def test_a_malformed_or_empty_mask_is_refused(bad):
    with pytest.raises(ValueError):
        allowed_tokens(bad, 384)


def test_a_greedy_row_with_a_mask_reads_as_greedy():
    assert SamplingParams.from_json({MASK_KEY: "x"}) == SamplingParams()


# ---- parsing what users give ---------------------------------------------------------------------------

def openai_line(body_extra: dict) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}], **body_extra}})


@pytest.mark.parametrize("extra, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     Constraint.json_schema(PERSON)),
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_choice": CHOICES}, Constraint.choice(CHOICES)),
    ({"guided_regex": REGEX}, Constraint("regex", REGEX)),
    ({}, None),
])
def test_openai_lines_carry_their_constraint_into_the_item(extra, expected):
    outcome = parse_jsonl_line(openai_line(extra), "generate", "in.jsonl", 3)
    assert outcome.problems == []
    assert constraint_of(outcome.record.params, {}) == expected


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objectx"}}}},
     "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, "look-around"),
    ({"guided_regex": "[0-9"}, "does not compile"),
    ({"response_format": {"type": "xml"}}, "must be \"json_schema\""),
    ({"guided_choice": []}, "non-empty array"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "not several"),
])
def test_a_constraint_the_engine_cannot_compile_is_refused_with_its_line(extra, words):
    outcome = parse_jsonl_line(openai_line(extra), "generate", "in.jsonl", 7)
    assert outcome.record is None
    assert len(outcome.problems) == 1 and words in str(outcome.problems[0])
    assert str(outcome.problems[0]).startswith("in.jsonl:7: body.")


def test_job_constraints_from_the_command_line(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert job_constraint(str(schema), None, None) == {"type": "json_schema", "schema": PERSON}
    assert job_constraint(None, REGEX, None) == {"type": "regex", "pattern": REGEX}
    assert job_constraint(None, None, "yes, no") == {"type": "choice", "choices": ["yes", "no"]}
    assert job_constraint(None, None, None) is None
    item_wins = constraint_of({CONSTRAINT_KEY: {"type": "json_object"}}, {CONSTRAINT_KEY: {"type": "regex",
                                                                                            "pattern": "a"}})
    assert item_wins == Constraint("json_object")
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "type": "object",\n  "properties": {,}\n}\n')
    with pytest.raises(ValueError, match=re.escape(f"{broken}:3:")):
        job_constraint(str(broken), None, None)
    bad_type = tmp_path / "bad.json"
    bad_type.write_text(json.dumps({"type": "objectx"}))
    with pytest.raises(ValueError, match="does not compile"):
        job_constraint(str(bad_type), None, None)
    with pytest.raises(ValueError, match="empty choice"):
        job_constraint(None, None, "a,,b")


# ---- the broker's path without processes ------------------------------------------------------------

def fake_last_stage(rows, vocab: int) -> dict[int, tuple[int, float]]:
    """What the last stage does with a step's emitting rows, on logits that depend only on (slot's request,
    position): seeded noise, so a replayed position gets the same logits."""
    tokens = {}
    for slot, position, sampling in rows:
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * position + 7)) * 3
        if MASK_KEY in sampling:
            logits = logits.masked_fill(~allowed_tokens(sampling[MASK_KEY], vocab), float("-inf"))
        tokens[slot] = choose_token(logits, SamplingParams.from_json(sampling), position)
    return tokens


def drive(scheduler: Scheduler, requests: list[GenerationRequest], vocab: int, reset_at: int | None = None) -> dict:
    """Run the requests to the end as the pipeline would, one micro-batch step at a time; with reset_at, the
    stages lose their caches after that many steps (a re-plan) and every sequence re-prefills."""
    for request in requests:
        assert scheduler.submit(request, 0.0) is None
    results, steps = {}, 0
    while not scheduler.idle:
        for mb in range(scheduler.num_micro_batches):
            plan = scheduler.plan_step(mb, 0.0)
            if plan is None:
                continue
            rows = []
            for row in plan.rows:
                if row.emit:
                    mask = scheduler.token_mask(row.slot)
                    sampling = scheduler.active[row.slot].request.sampling.to_json()
                    if mask is not None:
                        sampling[MASK_KEY] = pack_mask(mask)
                    rows.append((row.slot, row.start + len(row.tokens), sampling))
            for result in scheduler.apply_result(plan, fake_last_stage(rows, vocab), 0.0):
                results[result.request_id] = result
            steps += 1
            if steps == reset_at:
                scheduler.reset_caches()
    return results


def grammar_scheduler(model_dir) -> Scheduler:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = read_model_info(model_dir)
    compiler = GrammarCompiler(model_dir, set(info.eos_ids), info.files.config.vocab_size)
    from layerbus.broker.detokenizer import IncrementalDetokenizer

    return Scheduler(BatchingConfig(num_slots=6, num_micro_batches=2, max_step_tokens=64), 1, set(info.eos_ids),
                     lambda: IncrementalDetokenizer(tokenizer), compiler.new)


def test_every_constrained_item_that_stops_matches_its_constraint(tiny):
    requests, constraint_by_id = mixed_requests(tiny, 18)
    results = drive(grammar_scheduler(tiny), requests, read_model_info(tiny).files.config.vocab_size)
    assert sorted(results) == sorted(constraint_by_id)
    stopped = 0
    for rid, result in results.items():
        assert result.error is None, result.error
        if result.finish_reason == "stop" and constraint_by_id[rid] is not None:
            check_output(constraint_by_id[rid], result.text)
            stopped += 1
    # Random logits under a mask still reach the end of a choice, a regex and a bounded schema.
    choice_and_regex = [r for r, c in constraint_by_id.items() if c is not None and c.kind in ("choice", "regex")]
    assert all(results[r].finish_reason == "stop" for r in choice_and_regex)
    assert stopped >= len(choice_and_regex)


def test_a_reprefill_mid_run_rebuilds_the_grammar_and_changes_no_output(tiny):
    requests, _ = mixed_requests(tiny, 12)
    vocab = read_model_info(tiny).files.config.vocab_size
    straight = drive(grammar_scheduler(tiny), requests, vocab)
    replanned = drive(grammar_scheduler(tiny), requests, vocab, reset_at=9)
    assert {r: v.token_ids for r, v in replanned.items()} == {r: v.token_ids for r, v in straight.items()}


def test_a_token_the_grammar_refuses_fails_its_item_instead_of_passing_as_valid(tiny):
    scheduler = grammar_scheduler(tiny)
    request = GenerationRequest("r", [5, 6, 7], max_new_tokens=8, constraint=Constraint.choice(["yes"]))
    assert scheduler.submit(request, 0.0) is None
    plan = scheduler.plan_step(0, 0.0)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    wrong = tokenizer.encode("no")[0]
    [result] = scheduler.apply_result(plan, {plan.rows[0].slot: (wrong, -1.0)}, 0.0)
    assert result.finish_reason == "error" and "breaks the constraint" in result.error


def test_unconstrained_steps_carry_no_mask_and_load_no_grammar(tiny):
    """Unconstrained requests never build a grammar (the broker imports the engine at the first constrained
    request): the rows are exactly what they were before constrained decoding existed."""
    built = []
    scheduler = Scheduler(BatchingConfig(num_slots=2, num_micro_batches=1), 1, {2},
                          new_grammar=lambda c: built.append(c))
    scheduler.submit(GenerationRequest("r", [5, 6], max_new_tokens=2), 0.0)
    plan = scheduler.plan_step(0, 0.0)
    assert scheduler.token_mask(plan.rows[0].slot) is None and built == []


# ---- layerbus submit ---------------------------------------------------------------------------------

SUBMIT = """
import json, sys
from layerbus.cli.main import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exit:
    code = exit.code
heavy = [m for m in ("torch", "transformers.modeling_utils") if m in sys.modules]
print("RESULT " + json.dumps({"code": code, "heavy": heavy, "llguidance": "llguidance" in sys.modules}))
"""


def submit(tmp_path, *args: str) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", SUBMIT, json.dumps(["submit", *args,
                                                                       "--db", f"sqlite:///{tmp_path / 's.db'}"])],
                            capture_output=True, text=True, timeout=120,
                            env={"LAYERBUS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})
    return json.loads(result.stdout.splitlines()[-1].removeprefix("RESULT ")), result.stderr


def test_submit_checks_constraints_by_compiling_them_without_importing_torch(tiny, tmp_path):
    lines = tmp_path / "batch.jsonl"
    good = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": "x"}}}
    lines.write_text(openai_line({"response_format": good}) + "\n" + openai_line({"response_format": bad}).replace(
        '"a"', '"b"', 1) + "\n")
    refused, stderr = submit(tmp_path, str(lines), "--task", "generate", "--model", str(tiny))
    assert refused["code"] == 2 and f"{lines}:2: body.response_format does not compile" in stderr, stderr
    assert refused["heavy"] == [] and refused["llguidance"]
    lines.write_text(openai_line({"response_format": good}) + "\n")
    queued, stderr = submit(tmp_path, str(lines), "--task", "generate", "--model", str(tiny))
    assert queued["code"] == 0 and queued["heavy"] == [], stderr

    schema = tmp_path / "schema.json"
    schema.write_text('{\n  "type": "object",\n  "required": ["a"\n}\n')
    broken, stderr = submit(tmp_path, str(lines), "--task", "generate", "--model", str(tiny), "--json-schema", str(schema))
    assert broken["code"] == 2 and f"{schema}:4:" in stderr, stderr
    choices, stderr = submit(tmp_path, str(lines), "--task", "generate", "--model", str(tiny), "--choices", "yes,no")
    assert choices["code"] == 0 and choices["heavy"] == [], stderr


def test_plain_jobs_do_not_load_the_grammar_engine(tiny, tmp_path):
    lines = tmp_path / "plain.jsonl"
    lines.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    plain, stderr = submit(tmp_path, str(lines), "--task", "generate", "--model", str(tiny))
    assert plain["code"] == 0 and not plain["llguidance"], stderr


def test_a_model_without_tokenizer_json_fails_constrained_requests_not_the_run(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        GrammarCompiler(tmp_path, {2}, 384)
    scheduler = Scheduler(BatchingConfig(num_slots=2, num_micro_batches=1), 1, {2},
                          new_grammar=lambda c: GrammarCompiler(tmp_path, {2}, 384).new(c))
    failed = scheduler.submit(GenerationRequest("r", [5, 6], constraint=Constraint("json_object")), 0.0)
    assert failed.finish_reason == "error" and "tokenizer.json" in failed.error
    assert scheduler.submit(GenerationRequest("free", [5, 6]), 0.0) is None
