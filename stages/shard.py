"""A stage's slice of the model: decoder layers `[start, end)` plus the embedding or the head.

The slice is cut from transformers' own model class built on the meta device (which allocates
nothing), so each architecture's layer code, RoPE variant, embedding scaling and biases are the
library's own. Only the kept modules are materialized, and only their tensors are read from the
safetensors files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from layerbus.models.model_files import ModelDirError, ModelFiles
from layerbus.models.tensor_reader import TensorReader
from layerbus.stages.attention import ATTENTION_NAME, prefer_low_overhead_attention
from layerbus.stages.packed_linear import PackedEmbedding, PackedLinear, pack_linears
from layerbus.stages.weight_sources import block_source, to_device
from layerbus.wire.spans import LayerRange

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ShardSpec:
    """What a stage is told to load."""

    layers: LayerRange  # decoder layers held by this stage
    is_first: bool  # holds the token embedding (receives token ids)
    is_last: bool  # holds the final norm and the LM head (emits tokens)
    device: str = "cpu"  # "cpu", "cuda:N" or "mps"
    dtype: str = "float32"  # "float32", "bfloat16" or "float16"
    # Block layout ("q8_0", "q4_1", ...) the decoder layers' linear weights are quantized into as they are
    # read (wire.weight_formats: --weights int8 / int4); None keeps them in `dtype`.
    quantize_to: str | None = None
    # Hold the checkpoint's own blocks where it has them (--weights native: a GGUF kept in the model
    # directory); without a GGUF the safetensors are the checkpoint's format and load as `dtype`.
    native: bool = False


class StageShard(nn.Module):
    """The modules one stage runs, in order: [embed] -> layers -> [norm -> lm_head]."""

    def __init__(self, spec: ShardSpec, config, embed: nn.Module | None, layers: list[nn.Module],
                 norm: nn.Module | None, lm_head: nn.Module | None, rotary: nn.Module):
        super().__init__()
        self.spec = spec
        self.config = config
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb = rotary
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        # Per held layer: the sliding window it attends over, or None for full attention.
        window = getattr(config, "sliding_window", None)
        self.layer_windows = [
            window if (layer_types[i] == "sliding_attention" or _always_sliding(config)) and window else None
            for i in spec.layers
        ]

    @property
    def attends_in_place(self) -> bool:
        """Decode rows attend over their own slots in place (no padding, no gather)."""
        return self.config._attn_implementation == ATTENTION_NAME

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.device)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.spec.dtype]

    def block_layouts(self) -> str | None:
        """The block layouts held ("q4_1, q8_0"), or None when every weight is in full precision."""
        layouts = sorted({m.layout.name for m in self.modules() if isinstance(m, PackedLinear)})
        return ", ".join(layouts) or None

    def parameter_bytes(self) -> int:
        """Bytes of the weights held: distinct parameters (a tied head shared with the embedding counts
        once) and the blocks of packed linear layers."""
        seen = {}
        for param in self.parameters():
            seen[param.data_ptr()] = param.numel() * param.element_size()
        packed = sum(module.weight_bytes() for module in self.modules() if isinstance(module, PackedLinear))
        return sum(seen.values()) + packed


def _always_sliding(config) -> bool:
    # Mistral applies its sliding window on every layer and has no layer_types.
    return config.model_type == "mistral"


def load_shard(files: ModelFiles, spec: ShardSpec) -> StageShard:
    """Build the stage's modules on the meta device, then materialize and fill only those."""
    if spec.dtype not in DTYPES:
        raise ModelDirError(f"dtype {spec.dtype!r} is not one of {sorted(DTYPES)}")
    if spec.layers.end > files.num_layers:
        raise ModelDirError(f"layer range {spec.layers} is beyond the model's {files.num_layers} layers")
    config = _runtime_config(files)
    dtype = DTYPES[spec.dtype]
    attention = config._attn_implementation
    config._attn_implementation = "sdpa"  # from_config checks the name against its own list
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    config._attn_implementation = attention  # modules read it from the shared config at run time
    base = skeleton.model
    embed = base.embed_tokens if spec.is_first else None
    layers = [base.layers[i] for i in spec.layers]
    norm = base.norm if spec.is_last else None
    lm_head = skeleton.lm_head if spec.is_last else None
    device = torch.device(spec.device)
    prefer_low_overhead_attention(device)

    reader = TensorReader(files.tensor_files, files.path)
    source = block_source(files, spec.quantize_to, spec.native, reader)
    if source is not None:
        for index, layer in zip(spec.layers, layers):
            pack_linears(layer, lambda name: source.layout(f"model.layers.{index}.{name}.weight"),
                         lambda name: f"model.layers.{index}.{name}")
        if embed is not None and source.layout("model.embed_tokens.weight"):
            embed = PackedEmbedding(embed.num_embeddings, embed.embedding_dim, dtype)
            embed.load_blocks(to_device(source.read("model.embed_tokens.weight"), device))

    names = {}
    if embed is not None and not isinstance(embed, PackedEmbedding):
        names[embed] = "model.embed_tokens"
    for index, layer in zip(spec.layers, layers):
        names[layer] = f"model.layers.{index}"
    if norm is not None:
        names[norm] = "model.norm"
    for module, prefix in names.items():
        _materialize(module, prefix, reader, device, skeleton, source)
    if lm_head is not None:
        lm_head = _load_head(lm_head, embed, files, reader, device, source)
    # inv_freq is a non-persistent buffer: it is not in the checkpoint and to_empty() left garbage,
    # so the rotary module is rebuilt on the real device, which computes it afresh.
    with torch.device(device):
        rotary = type(base.rotary_emb)(config=config)
    shard = StageShard(spec, config, embed, layers, norm, lm_head, rotary)
    shard.eval()
    return shard


def _runtime_config(files: ModelFiles):
    config = files.config.__class__.from_dict(files.config.to_dict())
    # Gemma2 caps attention logits, which neither SDPA nor layerbus's decode kernel does: it runs
    # transformers' eager attention over padded, masked keys. Everything else runs stages.attention.
    needs_eager = getattr(config, "attn_logit_softcapping", None) is not None
    config._attn_implementation = "eager" if needs_eager else ATTENTION_NAME
    return config


def _materialize(module: nn.Module, prefix: str, reader: TensorReader, device, skeleton, source) -> None:
    module.to_empty(device=device)
    # Non-persistent buffers (e.g. Gemma's embedding scale) are not in the checkpoint; the model's
    # own initializer knows their values. It also writes random weights, so it runs before loading.
    for sub in module.modules():
        if getattr(sub, "_non_persistent_buffers_set", None) and not isinstance(sub, PackedLinear):
            skeleton._init_weights(sub)
    with torch.no_grad():
        for key, target in module.state_dict(keep_vars=True).items():
            reader.read_into(f"{prefix}.{key}", target)
        for name, sub in module.named_modules():
            if isinstance(sub, PackedLinear):  # one tensor at a time: only it is held beside the blocks
                sub.load_blocks(to_device(source.read(f"{prefix}.{name}.weight"), device))


def _load_head(lm_head: nn.Module, embed: nn.Module | None, files: ModelFiles, reader: TensorReader,
               device, source) -> nn.Module:
    tied = getattr(files.config, "tie_word_embeddings", False) or not files.has_tensor("lm_head.weight")
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if tied and isinstance(embed, PackedEmbedding):
        return embed.table  # one stage holds both ends: share the blocks, as transformers shares the matrix
    if tied and embed is not None:
        lm_head.weight = embed.weight  # one stage holds both ends: share, as transformers does
        return lm_head
    layout = source.layout(name) if source is not None else None
    if layout is not None and getattr(lm_head, "bias", None) is None:
        packed = PackedLinear(lm_head.in_features, lm_head.out_features, layout, None)
        packed.load_blocks(to_device(source.read(name), device))
        return packed
    lm_head.to_empty(device=device)
    with torch.no_grad():
        reader.read_into(name, lm_head.weight)
        if getattr(lm_head, "bias", None) is not None:
            reader.read_into("lm_head.bias", lm_head.bias)
    return lm_head
