"""What each weight format and wire codec pair costs in quality against the unquantized model
(`layerbus quality`), teacher-forced over a corpus as stages/wire_quality.py measures the wire alone.

Every prompt runs once through the reference (float32 weights, float32 wire), then through the model
split at the cuts with each weight format's shards (loaded as a stage loads them: `int8`/`int4`
quantized on load, `native` the checkpoint's own blocks) and each codec round-tripping the hidden
states at every cut. At every position: KL(reference || pair), whether the top token is unchanged,
how many of the reference's top 5 tokens are still in the top 5, and the perplexity of the prompt's
own next tokens. One process, the stages' own shard and step code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from layerbus.models.attention_shape import attention_shape
from layerbus.models.model_files import open_model_dir
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.shard import ShardSpec, StageShard, load_shard
from layerbus.stages.wire_quality import CodecQuality, round_trip, spans_for_cuts
from layerbus.wire import codecs
from layerbus.wire.protocol import StepRow
from layerbus.wire.weight_formats import choose_weights

REFERENCE = ("fp32", "float32")  # (weights, wire) every pair is compared with


@dataclass
class PairQuality(CodecQuality):
    """One (weight format, wire codec) pair against the reference."""

    weights: str = "fp32"
    top5: float = 0.0  # mean share of the reference's 5 most likely tokens still among the pair's 5
    _top5: int = 0

    def add(self, ref_log_probs: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor) -> None:
        super().add(ref_log_probs, log_probs, targets)
        ref5, pair5 = ref_log_probs.topk(5, dim=-1).indices, log_probs.topk(5, dim=-1).indices
        self._top5 += int((ref5[:, :, None] == pair5[:, None, :]).any(-1).sum())
        self.top5 = self._top5 / (5 * self.positions)


class FormatChain:
    """The model in one weight format, split at the cuts: its shards and a KV arena for each."""

    def __init__(self, files, spans, weights: str, longest: int):
        choice = choose_weights(None, weights, "float32")
        self.shards: list[StageShard] = [
            load_shard(files, ShardSpec(span, i == 0, i == len(spans) - 1, "cpu", choice.dtype, choice.quantize_to,
                                        native=choice.name == "native"))
            for i, span in enumerate(spans)]
        shape = attention_shape(files.config)
        self.arenas = [KVArena(list(span), 1, shape.kv_heads, shape.head_dim, shard.dtype, shard.device, longest)
                       for span, shard in zip(spans, self.shards)]

    def first(self, prompt: list[int]) -> torch.Tensor:
        return run_step(self.shards[0], self.arenas[0], [StepRow(0, 0, len(prompt))], torch.tensor(prompt))

    def finish(self, states: torch.Tensor, wire: str, length: int) -> torch.Tensor:
        """Log-probs [T-1, V] of the prompt's next tokens, `states` crossing every cut through `wire`."""
        rows = [StepRow(0, 0, length)]  # start 0 rewinds each arena's slot: every run starts fresh
        for shard, arena in zip(self.shards[1:], self.arenas[1:]):
            states = run_step(shard, arena, rows, round_trip(wire, states).to(shard.dtype))
        return torch.log_softmax(head_logits(self.shards[-1], states[:-1]).float(), dim=-1)


def measure_quality(model_dir: str | Path, prompts: list[list[int]], cuts: list[int], formats: Sequence[str],
                    wires: Sequence[str], progress: Callable[[int, int], None] | None = None) -> list[PairQuality]:
    """Every (format, wire) pair's quality against the reference, teacher-forced over `prompts`."""
    files = open_model_dir(model_dir)
    spans = spans_for_cuts(files.config.num_hidden_layers, cuts)
    longest = max(len(p) for p in prompts)
    chains = {name: FormatChain(files, spans, name, longest) for name in dict.fromkeys([REFERENCE[0], *formats])}
    float32_bytes = codecs.wire_bytes("float32", 1, files.config.hidden_size)
    pairs = [PairQuality(wire, weights=name, bytes_ratio=codecs.wire_bytes(wire, 1, files.config.hidden_size)
                         / float32_bytes) for name in formats for wire in wires]
    with torch.inference_mode():
        for done, prompt in enumerate(prompts):
            if len(prompt) < 2:
                continue
            targets = torch.tensor(prompt[1:])
            reference = chains[REFERENCE[0]].finish(chains[REFERENCE[0]].first(prompt), REFERENCE[1], len(prompt))
            for name in formats:
                chain = chains[name]
                states = chain.first(prompt)
                for pair in (p for p in pairs if p.weights == name):
                    pair.add(reference, chain.finish(states, pair.codec, len(prompt)), targets)
            if progress is not None:
                progress(done + 1, len(prompts))
    return pairs


def quality_report(model_dir: str | Path, prompts: list[list[int]], corpus: str, cuts: list[int],
                   formats: Sequence[str], wires: Sequence[str],
                   progress: Callable[[int, int], None] | None = None) -> dict:
    """The JSON `layerbus quality --json` prints."""
    started = time.monotonic()
    pairs = measure_quality(model_dir, prompts, cuts, formats, wires, progress)
    return {"model": str(model_dir), "corpus": corpus, "cuts": cuts, "prompts": len(prompts),
            "reference": {"weights": REFERENCE[0], "wire": REFERENCE[1]},
            "seconds": round(time.monotonic() - started, 1),
            "pairs": [_pair_json(p) for p in pairs]}


def _pair_json(pair: PairQuality) -> dict:
    data = pair.to_json()
    data["wire"] = data.pop("codec")
    data["ppl_reference"] = data.pop("ppl_float32")
    return data
