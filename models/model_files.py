"""Reading a Hugging Face model directory: its config, and which safetensors file holds each tensor.

Only names and file offsets are read here; tensors are read one at a time by the shard loader, so
a stage never touches the weights of layers it does not hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Decoder-only families whose checkpoints use the Llama layout (model.embed_tokens, model.layers.N,
# model.norm, lm_head) and whose decoder layers take (hidden, mask, position_embeddings, cache).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
}
SUPPORTED_DTYPES = {"float32", "float16", "bfloat16"}


class ModelDirError(ValueError):
    """A model directory that cannot be used, with what is wrong and what to do."""


@dataclass(frozen=True)
class ModelFiles:
    """A validated model directory: its config and where each checkpoint tensor lives."""

    path: Path  # the model directory
    config: "PretrainedConfig"  # transformers' config for the architecture
    tensor_files: dict[str, Path]  # checkpoint tensor name -> the safetensors file holding it

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def architecture(self) -> str:
        return (self.config.architectures or ["?"])[0]

    def has_tensor(self, name: str) -> bool:
        return name in self.tensor_files


def open_model_dir(path: str | Path) -> ModelFiles:
    """Validate a model directory (config, architecture, safetensors files) without reading weights."""
    path = _existing_dir(path)
    config = _read_config(path)
    tensor_files = _index_tensors(path)
    files = ModelFiles(path=path, config=config, tensor_files=tensor_files)
    _check_layer_tensors(path, files.num_layers, tensor_files)
    return files


def check_model_dir(path: str | Path) -> None:
    """The checks of `open_model_dir` on the files alone (config.json read as JSON, the safetensors
    headers), without transformers: for commands that compute nothing (`submit`), which must not
    import torch. ModelDirError names what is wrong."""
    path = _existing_dir(path)
    raw = _read_raw_config(path)
    layers = raw.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ModelDirError(f"{path / 'config.json'}: num_hidden_layers must be a positive integer, got {layers!r}")
    _check_layer_tensors(path, layers, _index_tensors(path))


def _existing_dir(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist; pass a Hugging Face model directory "
                            "(config.json + *.safetensors) or run `layerbus model default`")
    return path


def _read_config(path: Path) -> "PretrainedConfig":
    from transformers import AutoConfig  # imports torch: only where the config is used to compute

    _read_raw_config(path)
    config_file = path / "config.json"
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as error:  # transformers raises many types for a bad config; all mean the same here
        raise ModelDirError(f"{config_file} could not be read by transformers: {error}") from None


def _read_raw_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelDirError(f"{config_file} is not readable JSON: {error}") from None
    architectures = raw.get("architectures") or []
    if not architectures or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelDirError(
            f"{path}: architecture {architectures or 'unknown'} is not supported; layerbus runs decoder-only "
            f"models with the Llama layout: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in SUPPORTED_DTYPES:
        raise ModelDirError(f"{config_file}: dtype {dtype!r} is not one of {sorted(SUPPORTED_DTYPES)}")
    if raw.get("quantization_config"):
        try:
            compressed_scheme(raw)  # the one pre-quantized format read as it is; others are refused here
        except ModelDirError as error:
            raise ModelDirError(f"{config_file}: {error}") from None
    return raw


def _index_tensors(path: Path) -> dict[str, Path]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelDirError(f"{index_file} is not a valid index (needs a 'weight_map'): {error}") from None
        missing = sorted({name for name in weight_map.values() if not (path / name).is_file()})
        if missing:
            raise ModelDirError(f"{path}: shard(s) {', '.join(missing)} named in {index_file.name} are missing; "
                                "re-download or re-save the model")
        return {tensor: path / file for tensor, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = ", ".join(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".gguf"}) or "none"
        raise ModelDirError(f"{path} has no *.safetensors weights (weight files found: {found}); layerbus never "
                            "unpickles .bin/.pt files: convert with `save_pretrained(safe_serialization=True)`")
    tensor_files = {}
    for file in files:
        for name in safetensors_tensor_names(file):
            tensor_files[name] = file
    return tensor_files


# A safetensors header larger than this is not one (the format's own reader refuses above 100 MB).
_MAX_SAFETENSORS_HEADER = 100_000_000


def safetensors_tensor_names(file: Path) -> list[str]:
    """The tensor names in a safetensors file's header: an 8-byte little-endian length, then that many bytes
    of JSON mapping each name to its dtype, shape and offsets. Read here rather than with `safe_open`, which
    needs a framework: numpy's import took 0.2-0.3 s of a small submit, and "pt" would import torch. The
    stage's loader reads the tensors themselves with safetensors."""
    try:
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 2 <= length <= min(_MAX_SAFETENSORS_HEADER, file.stat().st_size - 8):
                raise ValueError(f"header length {length} does not fit the file's {file.stat().st_size} bytes")
            header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as error:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelDirError(f"{file} is not a readable safetensors file: {error}; re-download or re-save the "
                            "model") from None
    return [name for name in header if name != "__metadata__"]


def _check_layer_tensors(path: Path, num_layers: int, tensor_files: dict[str, Path]) -> None:
    # A cheap completeness check: every layer must have at least one tensor under model.layers.N.
    present = {int(name.split(".")[2]) for name in tensor_files if name.startswith("model.layers.")}
    missing = [i for i in range(num_layers) if i not in present]
    if missing:
        raise ModelDirError(f"{path}: no weights for layer(s) {missing[:10]} of {num_layers}; "
                            "the checkpoint is incomplete or uses a layout other than model.layers.N")
    if "model.embed_tokens.weight" not in tensor_files:
        raise ModelDirError(f"{path}: no model.embed_tokens.weight; the checkpoint uses another layout")


@dataclass(frozen=True)
class CompressedScheme:
    """The one compressed-tensors scheme layerbus reads."""

    group_size: int  # weights per scale along the input dimension (a multiple of 32)


def compressed_scheme(raw_config: dict) -> CompressedScheme | None:
    """The scheme of a config.json (as a dict) declaring compressed-tensors, None when it declares no
    quantization; ModelDirError naming what is read when it is another one."""
    quantization = raw_config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    groups = list((quantization.get("config_groups") or {}).values())
    weights = groups[0].get("weights") or {} if len(groups) == 1 else {}
    group_size = weights.get("group_size") or 0
    readable = (method == "compressed-tensors" and quantization.get("format") == "pack-quantized"
                and weights.get("num_bits") == 4 and weights.get("type") == "int" and weights.get("symmetric")
                and weights.get("strategy") == "group" and group_size % 32 == 0 and group_size > 0
                and not groups[0].get("input_activations"))
    if not readable:
        raise ModelDirError(
            f"config.json declares quantization {method!r} ({quantization.get('format', '?')}); layerbus reads "
            "compressed-tensors pack-quantized 4-bit symmetric groups of a multiple of 32 (W4A16), a GGUF "
            "(`layerbus model import-gguf FILE --out DIR`) or plain safetensors")
    return CompressedScheme(group_size)
