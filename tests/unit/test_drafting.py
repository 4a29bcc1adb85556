"""Drafters (broker/drafting.py): prompt lookup over the sequence's own tokens, the job's finished outputs within a
token bound, and the broker's per-row draft limits (output budget, end-of-sequence drafts)."""

from __future__ import annotations

from layerbus.broker.drafting import FirstOf, JobOutputs, PromptLookup, SequenceLookup
from layerbus.broker.requests import GenerationRequest
from layerbus.broker.sequences import Sequence
from layerbus.broker.speculation import Speculation
from layerbus.planner.speculation import SpeculationConfig


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match():
    lookup = SequenceLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8], min_match=1, max_match=3)
    lookup.extend([1, 2, 3])  # ends with 1 2 3: the 3-gram matches at the start, followed by 4 5 9
    assert PromptLookup().propose(lookup, 3) == [4, 5, 9]
    lookup.extend([6, 2, 3])  # "6 2 3" is new, "2 3" was last followed by 6 (the latest occurrence)
    assert lookup.propose(4) == [6, 2, 3]
    lookup.extend([42])  # never seen: nothing to propose
    assert lookup.propose(4) == []


def test_a_sequence_never_matches_its_own_unfinished_tail():
    lookup = SequenceLookup([5, 6, 7], min_match=1, max_match=2)
    assert lookup.propose(2) == []  # "6 7" and "7" occur only at the end: nothing follows them yet


def test_job_outputs_draft_from_finished_outputs_within_a_bound():
    outputs = JobOutputs(min_match=2, max_match=3, max_tokens=10)
    outputs.finished([10, 11, 12, 13, 14])
    lookup = SequenceLookup([99, 11, 12], min_match=2, max_match=3)
    assert outputs.propose(lookup, 2) == [13, 14]
    outputs.finished([20, 21, 22, 23, 24, 25, 26])  # over the bound: the first output is forgotten
    assert outputs.held <= 10
    assert outputs.propose(lookup, 2) == []
    assert FirstOf(PromptLookup(), outputs).propose(SequenceLookup([7, 21, 22], 2, 3), 3) == [23, 24, 25]


def test_rows_draft_within_the_output_budget_and_never_an_end_of_sequence_token():
    speculation = Speculation(SpeculationConfig(mode="ngram", max_draft=4))
    prompt = [1, 2, 3, 4, 0, 6, 1, 2, 3, 4, 5]
    near_end = Sequence(GenerationRequest("a", prompt, max_new_tokens=4), slot=0, admitted_at=0.0,
                        cached=len(prompt) + 1, generated=[1, 2])
    rows = speculation.decode_rows([near_end], 1, eos_ids={0}, max_context=2048)
    # After "1 2" comes "3 4 0 ...": one token of budget is left after this trip's own, and 0 is EOS anyway.
    assert rows[0].tokens == [2, 3] and rows[0].drafts == 1
    short = [1, 2, 3, 4, 0, 6, 7]
    eos_next = Sequence(GenerationRequest("b", short, max_new_tokens=40), slot=1, admitted_at=0.0,
                        cached=len(short) + 2, generated=[1, 2, 3])
    row = speculation.decode_rows([eos_next], 1, eos_ids={0}, max_context=2048)[0]
    assert row.tokens == [3, 4] and row.drafts == 1  # 3 4 0: cut at the EOS draft
    off = Speculation(SpeculationConfig(mode="off"))
    assert off.decode_rows([eos_next], 1, eos_ids={0}, max_context=2048)[0].tokens == [3]
