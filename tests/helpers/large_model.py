"""A 1.28-billion-parameter Llama with random weights, written straight to safetensors shards (a
layer at a time, never the whole model in memory) in bfloat16: 2.6 GB on disk, 5.1 GB once loaded in
float32. For the tests that show quantized weights fitting where full precision cannot."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from tests.helpers.tiny_models import make_tiny_tokenizer

# hidden 2048, 24 layers, MLP 5952 (a multiple of 32, as the blocks need), the tiny tokenizer's
# vocabulary: 24 x 53.35M + 0.8M (tied embedding) = 1.2812B parameters.
DIMENSIONS = dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=5952, num_attention_heads=16,
                  num_key_value_heads=16, max_position_embeddings=512, tie_word_embeddings=True)


def make_large_model(out_dir: Path, seed: int = 0, num_layers: int | None = None) -> Path:
    """Write the model directory at `out_dir` (config, tokenizer, one shard per layer) and return it;
    `num_layers`: fewer layers of the same shapes (a smaller model whose matmuls are the 1.28B one's)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    dimensions = dict(DIMENSIONS, **({"num_hidden_layers": num_layers} if num_layers else {}))
    config = LlamaConfig(**dimensions, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         dtype="bfloat16", architectures=["LlamaForCausalLM"])
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config.hidden_size, config.intermediate_size
    std = 1 / hidden ** 0.5  # keeps the residual stream's scale through 24 random layers
    shards: list[dict[str, torch.Tensor]] = [{
        "model.embed_tokens.weight": _random((config.vocab_size, hidden), 1.0, generator),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shards.append({
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            **{prefix + f"self_attn.{p}_proj.weight": _random((hidden, hidden), std, generator) for p in "qkvo"},
            prefix + "mlp.gate_proj.weight": _random((inner, hidden), std, generator),
            prefix + "mlp.up_proj.weight": _random((inner, hidden), std, generator),
            prefix + "mlp.down_proj.weight": _random((hidden, inner), 1 / inner ** 0.5, generator),
        })
    weight_map, total = {}, 0
    for index, tensors in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out_dir / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return out_dir


def _random(shape: tuple[int, int], std: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)
