"""What a wire codec costs in quality, measured the way llama.cpp's `--kl-divergence` mode does.

Teacher-forced over a corpus: every prompt runs through the model split at the given cuts (the
layer indices where one stage hands over to the next), once with the float32 wire and once per codec,
with the hidden states round-tripped through the codec's encode/decode at every cut. At every
position we compare the next-token distributions: mean KL(float32 || codec), the share of positions
whose top token is unchanged, and the perplexity of the prompt's own next tokens. It runs in one
process with the stages' own shard and step code (a measurement, not a stage).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from layerbus.models.attention_shape import attention_shape
from layerbus.models.model_files import open_model_dir
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire import codecs
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange


@dataclass
class CodecQuality:
    """One codec against the float32 wire, over every scored position of the corpus."""

    codec: str
    positions: int = 0  # scored positions (each predicts the next prompt token)
    mean_kl: float = 0.0  # mean KL(P_float32 || P_codec), nats
    max_kl: float = 0.0  # worst single position
    same_top: float = 0.0  # share of positions whose argmax token is unchanged (0..1)
    ppl: float = 0.0  # perplexity of the corpus's next tokens with this codec on the wire
    ppl_float32: float = 0.0  # the same with the float32 wire
    bytes_ratio: float = 1.0  # bytes per hop against float32
    # running sums, dropped from the JSON
    _kl: float = field(default=0.0, repr=False)
    _same: int = field(default=0, repr=False)
    _nll: float = field(default=0.0, repr=False)
    _nll_ref: float = field(default=0.0, repr=False)

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change: PPL(codec) / PPL(float32) - 1."""
        return self.ppl / self.ppl_float32 - 1 if self.ppl_float32 else 0.0

    def to_json(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        data["ppl_change"] = self.ppl_change
        return data

    def add(self, ref_log_probs: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor) -> None:
        """Fold in one prompt: log-probs [T, V] of both runs and the T next tokens."""
        kl = (ref_log_probs.exp() * (ref_log_probs - log_probs)).sum(-1).clamp_min(0)
        self._kl += float(kl.sum())
        self.max_kl = max(self.max_kl, float(kl.max()))
        self._same += int((ref_log_probs.argmax(-1) == log_probs.argmax(-1)).sum())
        self._nll -= float(log_probs.gather(1, targets[:, None]).sum())
        self._nll_ref -= float(ref_log_probs.gather(1, targets[:, None]).sum())
        self.positions += int(targets.numel())
        self.mean_kl = self._kl / self.positions
        self.same_top = self._same / self.positions
        self.ppl = math.exp(self._nll / self.positions)
        self.ppl_float32 = math.exp(self._nll_ref / self.positions)


def spans_for_cuts(num_layers: int, cuts: list[int]) -> list[LayerRange]:
    """[0, c1), [c1, c2), ..., [ck, num_layers) for strictly increasing cuts inside (0, num_layers)."""
    bounds = [0, *cuts, num_layers]
    if any(b >= a for a, b in zip(bounds[1:], bounds)) or not cuts:
        raise ValueError(f"cuts {cuts} must be strictly increasing layer indices between 1 and {num_layers - 1}")
    return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]


def round_trip(codec: str, hidden: torch.Tensor) -> torch.Tensor:
    """What the next stage receives: through encode, the message's frames and decode."""
    meta, parts = codecs.encode(codec, hidden)
    return codecs.decode(meta, parts)


def measure_wire_quality(model_dir: str | Path, prompts: list[list[int]], cuts: list[int],
                         codec_names: tuple[str, ...] = codecs.CODEC_NAMES[1:],
                         progress: Callable[[int, int], None] | None = None) -> dict[str, CodecQuality]:
    """codec -> its quality against the float32 wire at `cuts`, teacher-forced over `prompts`."""
    files = open_model_dir(model_dir)
    config = files.config
    spans = spans_for_cuts(config.num_hidden_layers, cuts)
    shards = [load_shard(files, ShardSpec(span, i == 0, i == len(spans) - 1)) for i, span in enumerate(spans)]
    shape = attention_shape(config)
    longest = max(len(p) for p in prompts)
    arenas = [KVArena(list(span), 1, shape.kv_heads, shape.head_dim, shard.dtype, shard.device, longest)
              for span, shard in zip(spans, shards)]
    hidden = config.hidden_size
    results = {name: CodecQuality(name, bytes_ratio=codecs.wire_bytes(name, 1, hidden) / codecs.wire_bytes(
        "float32", 1, hidden)) for name in codec_names}
    for done, prompt in enumerate(prompts):
        if len(prompt) < 2:
            continue
        rows = [StepRow(0, 0, len(prompt))]  # start 0 rewinds each arena's slot: every run starts fresh
        first = run_step(shards[0], arenas[0], rows, torch.tensor(prompt))
        targets = torch.tensor(prompt[1:])

        def finish(codec: str) -> torch.Tensor:
            states = first
            for shard, arena in zip(shards[1:], arenas[1:]):
                states = run_step(shard, arena, rows, round_trip(codec, states))
            return torch.log_softmax(head_logits(shards[-1], states[:-1]), dim=-1)

        reference = finish("float32")
        for name in codec_names:
            results[name].add(reference, finish(name), targets)
        if progress is not None:
            progress(done + 1, len(prompts))
    return results


def quality_report(model_dir: str | Path, prompts: list[list[int]], corpus: str, cuts: list[int],
                   codec_names: tuple[str, ...] = codecs.CODEC_NAMES[1:],
                   progress: Callable[[int, int], None] | None = None) -> dict:
    """The JSON `layerbus wire-quality --json` prints and auto mode reads; `corpus` names where the
    prompts came from (jobs/corpus.py renders them)."""
    started = time.monotonic()
    results = measure_wire_quality(model_dir, prompts, cuts, codec_names, progress)
    return {"model": str(model_dir), "corpus": corpus, "cuts": cuts,
            "prompts": len(prompts), "seconds": round(time.monotonic() - started, 1),
            "codecs": {name: quality.to_json() for name, quality in results.items()}}
