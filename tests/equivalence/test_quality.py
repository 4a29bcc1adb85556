"""`layerbus quality`'s measurement on the default model: int8 weights agree with float32 ones within the target.
tests/unit/test_quality.py runs the command on the tiny model."""

from __future__ import annotations

from layerbus.jobs.corpus import corpus_prompts
from layerbus.models.model_info import load_tokenizer
from layerbus.stages.quality import measure_quality


def test_int8_weights_meet_the_quality_target_on_the_default_model(default_model):
    """int8 weights (Q8_0 g32, quantized on load) against float32 on the sample corpus's first 8
    documents: same top token at least 97.5% of positions, mean KL at most 0.003 (measured 97.6%, 0.0015)."""
    prompts = corpus_prompts(load_tokenizer(default_model))[:8]
    [pair] = measure_quality(default_model, prompts, [13, 26], ("int8",), ("float32",))
    assert pair.positions > 2000
    assert pair.same_top >= 0.975 and pair.mean_kl <= 0.003, (pair.same_top, pair.mean_kl)
