"""Incremental detokenization against the full decode with the default model's tokenizer: the tests of
tests/unit/test_detokenizer.py that take a `tokenizer`, run here on that one."""

from __future__ import annotations

import pytest

from layerbus.models.model_info import load_tokenizer
from tests.unit.test_detokenizer import (  # noqa: F401 - the same tests, collected here with this module's tokenizer
    test_stop_strings_end_where_the_whole_output_check_ended,
    test_text_equals_the_full_decode_at_every_step,
    test_the_tokens_of_real_text_come_back_exactly,
    test_tokens_fed_in_runs_give_the_same_text,
)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return load_tokenizer(default_model)
