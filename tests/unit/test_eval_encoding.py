"""Scoring token ids equal lm-evaluation-harness's own, called directly on the tiny test tokenizers.

lm-eval's TemplateLM.loglikelihood / _encode_pair and HFLM.tok_encode / prefix_token_id run unchanged on a
stand-in object holding a real tokenizer (building an HFLM would load a model); rolling windows are compared
with lm_eval.utils; left truncation is checked end to end against HFLM on a tiny model.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("lm_eval")
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer, processors  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from layerbus.evals.encoding import Encoder, disjoint_window, model_input, rolling_token_windows  # noqa: E402
from tests.helpers.tiny_models import BOS, EOS, PAD, UNK, _trained_tokenizer_json, make_tiny_tokenizer  # noqa: E402

# Characters random texts are drawn from: words the tokenizer merged, spaces (runs of them, trailing ones),
# newlines, punctuation, digits, non-ASCII, and the BOS marker's text.
PIECES = ["the", " stage", "layer", " ", "  ", "\n", "\t", ".", ",", "?", "42", "3.14", "é", "日本", "ß", "a", "Z",
          "'s", " end", BOS, "-"]


def random_text(rng: random.Random, max_pieces: int = 12) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, max_pieces)))


def tokenizer_variants() -> dict[str, PreTrainedTokenizerFast]:
    """The tiny tokenizer as built (no special tokens added), one that adds BOS itself, and one with no BOS."""
    adds_bos = Tokenizer.from_str(_trained_tokenizer_json())
    bos_id = adds_bos.token_to_id(BOS)
    adds_bos.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    common = dict(eos_token=EOS, pad_token=PAD, unk_token=UNK, clean_up_tokenization_spaces=False)
    return {
        "plain": make_tiny_tokenizer(),
        "adds_bos": PreTrainedTokenizerFast(tokenizer_object=adds_bos, bos_token=BOS, **common),
        "no_bos": PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()), **common),
    }


class LmEvalEncoding:
    """lm-eval's own encoding methods, unchanged, on an object that holds only what they read."""

    backend = "causal"
    chat_template_args: dict = {}
    tok_encode = HFLM.tok_encode
    tok_batch_encode = HFLM.tok_batch_encode
    apply_chat_template = HFLM.apply_chat_template
    prefix_token_id = HFLM.prefix_token_id
    _encode_pair = TemplateLM._encode_pair
    loglikelihood = TemplateLM.loglikelihood

    def __init__(self, tokenizer, add_bos_token, custom_prefix_token_id=None):
        self.tokenizer = tokenizer
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = custom_prefix_token_id

    def _loglikelihood_tokens(self, requests, **kwargs):
        return [(context_enc, continuation_enc) for _, context_enc, continuation_enc in requests]

    def encode(self, context: str, continuation: str):
        request = type("Request", (), {"args": (context, continuation)})
        return self.loglikelihood([request], disable_tqdm=True)[0]


VARIANTS = tokenizer_variants()
CASES = [(name, add_bos) for name in VARIANTS for add_bos in (None, True, False)]


@pytest.mark.parametrize("name, add_bos_token", CASES)
def test_encode_pair_equals_lm_eval_on_random_pairs(name, add_bos_token):
    tokenizer = VARIANTS[name]
    ours = Encoder(tokenizer, add_bos_token=add_bos_token)
    theirs = LmEvalEncoding(tokenizer, add_bos_token)
    assert ours.prefix_token_id == theirs.prefix_token_id
    rng = random.Random(f"{name}-{add_bos_token}")
    for _ in range(400):
        # A quarter of contexts are empty (the prefix-token path); the others often end in spaces.
        context = "" if rng.random() < 0.25 else random_text(rng) + rng.choice(["", " ", "  ", "\n"])
        continuation = random_text(rng, 4)
        ours_ids = ours.encode_pair(context, continuation)
        assert ours_ids == theirs.encode(context, continuation), (context, continuation)


def test_a_custom_prefix_token_is_used_as_lm_eval_uses_it():
    tokenizer = VARIANTS["plain"]
    ours, theirs = Encoder(tokenizer, custom_prefix_token_id=7), LmEvalEncoding(tokenizer, None, 7)
    for continuation in ["the stage", " 42", "é"]:
        assert ours.encode_pair("", continuation) == theirs.encode("", continuation)


@pytest.mark.parametrize("seed", range(40))
def test_rolling_windows_equal_lm_eval_utils(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(rng.randint(0, 60))]
    max_len = rng.randint(1, 20)
    context_len = rng.randint(1, max_len)
    expected = list(lm_utils.get_rolling_token_windows(tokens, 5, max_len, context_len))
    got = list(rolling_token_windows(tokens, 5, max_len, context_len))
    assert got == expected
    assert [disjoint_window(w) for w in got] == [lm_utils.make_disjoint_window(w) for w in expected]


@pytest.mark.parametrize("name", VARIANTS)
def test_rolling_windows_of_texts_equal_hflm(name):
    tokenizer = VARIANTS[name]
    theirs = LmEvalEncoding(tokenizer, None)
    rng = random.Random(name)
    for _ in range(50):
        text, max_length = random_text(rng, 40), rng.randint(2, 24)
        expected = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
            token_list=theirs.tok_encode(text), prefix_token=theirs.prefix_token_id, max_seq_len=max_length,
            context_len=1)]
        assert Encoder(tokenizer).rolling_windows(text, max_length) == expected


@pytest.mark.parametrize(
    "context, continuation, max_length, expected",
    [
        ([1, 2, 3], [4, 5], 10, [1, 2, 3, 4]),
        ([1, 2, 3], [4, 5], 4, [1, 2, 3, 4]),
        ([1, 2, 3], [4, 5], 3, [2, 3, 4]),  # left truncation keeps max_length + 1 tokens, then drops the last
        ([1, 2, 3], [4, 5], 2, [3, 4]),
        ([1], [4, 5, 6], 3, [1, 4, 5]),
    ],
)
def test_model_input_truncates_from_the_left(context, continuation, max_length, expected):
    assert model_input(context, continuation, max_length) == expected


@pytest.mark.parametrize("name, add_bos_token", CASES)
def test_generation_ids_equal_hflm_tok_batch_encode(name, add_bos_token):
    """generate_until's prompt ids: tok_batch_encode's BOS rule and its left truncation to max_length - max_gen_toks."""
    tokenizer = VARIANTS[name]
    ours, theirs = Encoder(tokenizer, add_bos_token=add_bos_token), LmEvalEncoding(tokenizer, add_bos_token)
    rng = random.Random(f"gen-{name}-{add_bos_token}")
    for _ in range(200):
        text = (BOS if rng.random() < 0.2 else "") + random_text(rng, 20)
        left_truncate_len = rng.randint(1, 30)
        ids, _ = theirs.tok_batch_encode([text], left_truncate_len=left_truncate_len)
        assert ours.generation_ids(text, left_truncate_len) == ids[0].tolist(), (text, left_truncate_len)


def test_stop_strings_add_the_decoded_eos_as_lm_eval_does():
    from lm_eval.models.utils import handle_stop_sequences

    encoder = Encoder(VARIANTS["plain"])
    for until in [[], ["\n\n"], ["Q:", EOS], [EOS]]:
        assert encoder.stop_strings(tuple(until)) == handle_stop_sequences(list(until), eos=EOS)
    assert encoder.stop_strings(()) == [EOS]


def test_chat_text_equals_hflm_apply_chat_template():
    tokenizer = make_tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    expected = LmEvalEncoding(tokenizer, None).apply_chat_template(messages)
    assert Encoder(tokenizer).chat_text(tuple(messages)) == expected
    assert expected.endswith("<|assistant|>\n") and expected.startswith(BOS)


def test_chat_text_drops_the_system_role_when_the_template_refuses_it_as_lm_eval_does():
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}|{% endfor %}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    expected = LmEvalEncoding(tokenizer, None).apply_chat_template(messages)
    assert Encoder(tokenizer).chat_text(messages) == expected == "2+2?|"


def test_chat_text_without_a_template_names_the_way_out():
    with pytest.raises(ValueError, match="chat"):
        Encoder(VARIANTS["no_bos"]).chat_text([{"role": "user", "content": "hi"}])


def test_model_input_refuses_a_continuation_longer_than_the_model():
    with pytest.raises(ValueError, match="exceeds max_length=2"):
        model_input([1], [4, 5, 6], 2)


def test_loglikelihoods_from_our_ids_equal_hflm_on_a_tiny_model(tiny_models):
    """End to end through lm-eval's HF backend: truncation and the scored positions match."""
    import torch
    from lm_eval.api.instance import Instance
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_models("llama")
    max_length = 12
    lm = HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=4, max_length=max_length)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    pairs = [("" if i % 5 == 0 else random_text(rng, 10 + i % 7), random_text(rng, 3)) for i in range(20)]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    expected = lm.loglikelihood(requests, disable_tqdm=True)
    encoder = Encoder(tokenizer)
    truncated = 0
    for (context, continuation), (ll, greedy) in zip(pairs, expected):
        context_ids, continuation_ids = encoder.encode_pair(context, continuation)
        ids = model_input(context_ids, continuation_ids, max_length)
        truncated += len(context_ids) + len(continuation_ids) > max_length + 1
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -len(continuation_ids):]  # [C, vocab]
        logprobs = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation_ids)
        ours = logprobs.gather(1, target[:, None]).sum().item()
        assert ours == pytest.approx(ll, abs=1e-4)
        assert bool((logprobs.argmax(-1) == target).all()) == greedy
    assert truncated >= 5, "the cases must exercise left truncation"
