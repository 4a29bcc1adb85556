"""Time the token mask of two grammar engines (llguidance, xgrammar) on CPU: per token, for a JSON schema,
on the default model's tokenizer. How layerbus chose its engine: docs/jobs.md, "Constrained decoding".

    .venv/bin/python bench/mask_engines.py [--model DIR] [--items 20]

Each engine compiles the same schema, then walks the tokens of valid instances: a mask before each token,
then the token is accepted, as decoding does. Needs both engines installed (xgrammar is not a dependency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "status", "score"],
    "additionalProperties": False,
}


def instances(count: int) -> list[str]:
    names = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
    return [json.dumps({"name": names[i % 5], "age": 20 + i, "email": f"user{'x' * (i % 7)}@mail.org",
                        "tags": ["a", f"tag number {i}"][: 1 + i % 2], "status": ["active", "banned"][i % 2],
                        "score": i * 1.25}) for i in range(count)]


def time_llguidance(tokenizer_json: str, eos: int, walks: list[list[int]]) -> tuple[float, float, list[float]]:
    import llguidance

    started = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    setup = time.perf_counter() - started
    started = time.perf_counter()
    llguidance.LLMatcher(tokenizer, grammar).compute_bitmask()  # compiles lazily: the first mask included
    compile_s = time.perf_counter() - started
    times = []
    for tokens in walks:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        for token in tokens:
            t0 = time.perf_counter()
            mask = matcher.compute_bitmask()
            times.append(time.perf_counter() - t0)
            assert mask[token // 8] >> (token % 8) & 1, "a valid instance's token was masked out"
            assert matcher.consume_token(token), matcher.get_error()
    return setup, compile_s, times


def time_xgrammar(hf_tokenizer, walks: list[list[int]]) -> tuple[float, float, list[float]]:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer)
    compiler = xgrammar.GrammarCompiler(info)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - started
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for tokens in walks:
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(token), "xgrammar refused a valid instance's token"
    return setup, compile_s, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the default model)")
    parser.add_argument("--items", type=int, default=20)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from layerbus.models.default_model import default_model_dir

    model_dir = args.model or default_model_dir()
    hf = AutoTokenizer.from_pretrained(model_dir)
    walks = [hf.encode(text, add_special_tokens=False) + [hf.eos_token_id] for text in instances(args.items)]
    tokenizer_json = (Path(model_dir) / "tokenizer.json").read_text()
    print(f"model {model_dir}: vocab {len(hf)}, {sum(map(len, walks))} tokens over {len(walks)} instances")
    for name, (setup, compile_s, times) in (("llguidance", time_llguidance(tokenizer_json, hf.eos_token_id, walks)),
                                 ("xgrammar", time_xgrammar(hf, walks))):
        times_us = sorted(t * 1e6 for t in times)
        print(f"{name:10s} tokenizer {setup * 1e3:6.1f} ms  schema {compile_s * 1e3:6.1f} ms  mask per token: median {statistics.median(times_us):7.1f} us"
              f"  p90 {times_us[int(len(times_us) * 0.9)]:7.1f} us  max {times_us[-1]:8.1f} us")


if __name__ == "__main__":
    main()
