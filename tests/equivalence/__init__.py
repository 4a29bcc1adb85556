"""The equivalence tier (`slow`): layerbus against references, token for token or within a stated tolerance:
N stages against single-process transformers, evals against lm-eval's HF backend, and the checks that need
the default real model."""
