"""Tiny random-weight models in the Hugging Face layout, built offline in about a second.

Tests use them wherever the real default model would be too slow: they are real transformers
architectures (Llama, Qwen2, Qwen3, Gemma, Mistral) saved with `save_pretrained`, so every code
path that loads a model directory sees the same files it would see for a downloaded model.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

# The tokenizer's training text. Fixed, so the vocabulary (and with it every model's
# vocab_size) is the same on every machine.
TRAINING_TEXT = """\
The stage receives a batch of hidden states, runs its layers, and sends the result on.
A model that is too large for one device can still be served when its layers are split
across several processes. Each process holds a contiguous range of layers, from start up to
but not including end. The first stage embeds the tokens; the last stage applies the final
norm and the language model head, then picks the next token.
The broker keeps a queue of jobs. A worker claims a job, reports progress, and writes the
answer to a table. If a worker stops sending heartbeats, its lease expires and the job goes
back to the queue. Nothing is lost when a process dies, and nothing is done twice.
Small models are useful in tests because they load in a moment and run on any computer.
Their weights are random, so their answers are nonsense, but the same seed gives the same
weights, and the same weights give the same answers. That is all a test of equivalence needs:
the split model must say exactly what the whole model says, token for token.
What is the capital of France? Paris is the capital of France. How many legs does a spider
have? A spider has eight legs. Write a short poem about the sea. The sea is wide and grey,
it sings at night and sleeps by day. Count from one to ten: one, two, three, four, five,
six, seven, eight, nine, ten. Numbers like 42, 3.14 and 1000 appear in text as well.
"""

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Byte-level BPE never needs an unknown token, but AutoTokenizer loads any qwen2 model's
# tokenizer as Qwen2Tokenizer, which adds "<|endoftext|>" as unk when the vocabulary lacks it
# (one id past the embedding matrix). Having it keeps len(tokenizer) == vocab_size everywhere.
UNK = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 384

# Qwen2Tokenizer also rebuilds the pipeline as NFC, this split and a regex-free byte-level
# step. Building the tiny tokenizer the same way makes it encode identically for every arch.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML-like: every turn ends with the EOS token, so a model that emits EOS ends its turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Length of the greedy continuations that choose the EOS token (see `_choose_eos_source`).
EOS_PROBE_NEW_TOKENS = 32

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma": GemmaConfig,
    "mistral": MistralConfig,
}

# Dimensions shared by every arch: small enough for < 1 s, large enough for grouped-query
# attention (4 query heads share 2 KV heads) and a multi-layer split.
BASE_DIMENSIONS: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    # The default 0.02 makes logits nearly uniform, so greedy picks hinge on 1e-6 ties that
    # differ between kernels. 0.2 spreads the top-2 logit gap to ~0.1 and still keeps
    # activations finite through the layers.
    "initializer_range": 0.2,
}

# Per-arch choices mirror the real model families, so both tied and untied heads are covered.
ARCH_DIMENSIONS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},  # attention biases are always on in Qwen2
    "qwen3": {"tie_word_embeddings": True},  # adds per-head q/k RMSNorm
    "gemma": {"tie_word_embeddings": True},  # scales embeddings by sqrt(hidden_size)
    # No sliding window by default: then Mistral computes what Llama does (same seed, same
    # bytes). Pass sliding_window=N to exercise windowed attention.
    "mistral": {"tie_word_embeddings": False, "sliding_window": None},
}


@lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process; the result is a pure function of the text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # The full byte alphabet means any text encodes, with no unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    return tokenizer.to_str()


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer with bos/eos/pad tokens and a chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def tiny_config(arch: str, tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> PretrainedConfig:
    """The transformers config for a tiny `arch` model; `overrides` win over every default."""
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"{arch=} is not a tiny-model architecture; choose one of {sorted(CONFIG_CLASSES)}")
    settings: dict[str, Any] = {
        **BASE_DIMENSIONS,
        **ARCH_DIMENSIONS[arch],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
        **overrides,
    }
    # Several config classes default head_dim to a large-model value (128, 256) instead of
    # deriving it, so derive it here unless the caller chose one.
    settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    return CONFIG_CLASSES[arch](**settings)


def _randomize_attention_biases(model: PreTrainedModel, std: float) -> None:
    """Qwen2's q/k/v biases start at zero; make them random so a stage that drops them is caught."""
    for name, parameter in model.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            parameter.data.normal_(mean=0.0, std=std)


def _greedy_continuations(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    """Greedy continuations of `<bos> t` for every ordinary token t, each run to full length.

    Every token as a prompt samples where greedy decoding goes from anywhere in the vocabulary,
    so what is frequent here is frequent after any prompt. One batch, no padding: ~0.2 s.
    """
    starts = [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids]
    input_ids = torch.tensor([[tokenizer.bos_token_id, t] for t in starts])  # [N, 2]
    no_stop = GenerationConfig(
        max_new_tokens=EOS_PROBE_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=no_stop)
    return output[:, input_ids.shape[1] :].tolist()


def _choose_eos_source(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> int:
    """The greedy token found in closest to half of the probe continuations.

    Promoted to EOS, it ends about half of greedy generations, each where it first appears, so
    lengths vary; the rest run to max_new_tokens. Ties go to the more frequent token, then to
    the smaller id, so the choice depends on the weights alone.
    """
    continuations = _greedy_continuations(model, tokenizer)
    total = Counter(token for tokens in continuations for token in tokens)
    found_in = Counter(token for tokens in continuations for token in set(tokens))
    candidates = [t for t in total if t not in tokenizer.all_special_ids]
    return min(candidates, key=lambda t: (abs(2 * found_in[t] - len(continuations)), -total[t], t))


def _relabel_token(model: PreTrainedModel, a: int, b: int) -> None:
    """Swap token ids `a` and `b` in the input embeddings and the output head.

    A random model with two vocabulary rows swapped is just another random model, but now it
    emits `b` exactly where it used to emit `a`. That lets the tokenizer's real EOS token be one
    the model actually produces, instead of a special token it never picks.
    """
    swap = torch.tensor([b, a])
    pair = torch.tensor([a, b])
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight  # [V, H]
        embeddings[pair] = embeddings[swap]
        head = model.get_output_embeddings()
        if head.weight.data_ptr() != embeddings.data_ptr():  # untied: the head has its own rows
            head.weight[pair] = head.weight[swap]
        if getattr(head, "bias", None) is not None:
            head.bias[pair] = head.bias[swap]


@contextmanager
def single_torch_thread() -> Iterator[None]:
    """Run torch on one thread inside the block, for tiny models.

    Matmuls this small gain nothing from threads, and on a busy machine (parallel test
    workers) thread hand-offs made tiny-model generation 3-20x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_tiny_model(arch: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random-weight `arch` model directory at `out_dir` and return it.

    The directory holds config.json, model.safetensors, generation_config.json and tokenizer
    files with a chat template. The same (arch, seed, overrides) gives byte-identical weights.
    Greedy generation ends at EOS for some prompts and runs on for others: the greedy token
    found in closest to half of the probe continuations is relabelled as the tokenizer's EOS.
    """
    out_dir = Path(out_dir)
    tokenizer = make_tiny_tokenizer()
    config = tiny_config(arch, tokenizer, **overrides)
    tokenizer.model_max_length = config.max_position_embeddings
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_attention_biases(model, std=config.initializer_range)
    model.eval()
    with single_torch_thread():
        eos_source = _choose_eos_source(model, tokenizer)
    _relabel_token(model, eos_source, tokenizer.eos_token_id)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_sharded_copy(model_dir: Path, out_dir: Path, max_shard_bytes: int) -> Path:
    """Copy `model_dir` to `out_dir` with its weights split into shards of at most `max_shard_bytes`.

    Produces `model-0000X-of-0000N.safetensors` plus `model.safetensors.index.json`, the layout
    `save_pretrained(max_shard_size=...)` writes. A tensor larger than the limit gets a shard
    of its own, as in transformers.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    weights_path = model_dir / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} not found: make_sharded_copy needs a single-file model directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy2(item, out_dir / item.name)

    with safe_open(weights_path, framework="pt") as weights:
        tensors = {name: weights.get_tensor(name) for name in weights.keys()}
        metadata = weights.metadata()
    shards = _split_into_shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        shard_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / shard_name, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, shard_name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return out_dir


def _split_into_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in file order: start a new shard when the next tensor would overflow this one."""
    if max_shard_bytes <= 0:
        raise ValueError(f"{max_shard_bytes=} must be positive")
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    return shards
