"""Turn a GGUF file into a safetensors model directory that stages can load by layer range.

transformers reads a GGUF (dequantizing every tensor) but refuses to `save_pretrained` what it
read, and stages load slices of safetensors files, so an import is a one-time conversion:
load, rebuild a plain model from the config, save.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

GGUF_MAGIC = b"GGUF"

# llama.cpp stops at any of these ids; transformers' loader reads only the first, so chat
# models whose turn ends with a separate end-of-turn token would never stop without the rest.
END_OF_GENERATION_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)

# Keys of transformers' GGUF config mapping that are metadata sections, not architectures.
_NON_ARCHITECTURE_KEYS = {"general", "tokenizer"}


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported, or an output directory that cannot take it."""


@dataclass(frozen=True)
class GGUFHeader:
    """What the import needs from a GGUF's metadata before transformers reads the file."""

    architecture: str  # `general.architecture`, llama.cpp's name (e.g. "llama", "qwen2")
    end_of_generation_ids: tuple[int, ...]  # eos, eot, eom ids present, in that order


def read_gguf_header(gguf_file: Path) -> GGUFHeader:
    """Check that `gguf_file` is a readable GGUF and read its architecture and stop tokens."""
    from gguf import GGUFReader  # heavy (numpy memmap machinery); only needed here

    gguf_file = Path(gguf_file)
    if not gguf_file.exists():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist: check the path")
    if gguf_file.is_dir():
        raise GGUFImportError(f"{gguf_file} is a directory: pass the .gguf file inside it")
    with gguf_file.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GGUFImportError(
            f"{gguf_file} is not a GGUF file: it starts with {magic!r}, a GGUF starts with {GGUF_MAGIC!r}"
        )
    try:
        reader = GGUFReader(gguf_file)
    except (ValueError, OSError, IndexError) as error:
        raise GGUFImportError(f"{gguf_file} has a GGUF header but cannot be read ({error}): is it truncated? "
                              "Download it again.") from error
    architecture_field = reader.fields.get("general.architecture")
    if architecture_field is None:
        raise GGUFImportError(f"{gguf_file} has no general.architecture field, so it is not a model GGUF")
    architecture = bytes(architecture_field.parts[architecture_field.data[0]]).decode("utf-8")
    stop_ids = tuple(
        int(reader.fields[key].parts[reader.fields[key].data[0]][0])
        for key in END_OF_GENERATION_KEYS
        if key in reader.fields
    )
    return GGUFHeader(architecture=architecture, end_of_generation_ids=tuple(dict.fromkeys(stop_ids)))


def import_gguf(gguf_file: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert `gguf_file` into a safetensors model directory at `out_dir` and return `out_dir`.

    The directory gets config.json, model.safetensors, generation_config.json (with every
    end-of-generation id the GGUF names) and the tokenizer files with its chat template.
    Weights are dequantized to `dtype`. The result appears under `out_dir` in one rename, so a
    killed import leaves at most a hidden `.<name>.partial-*` sibling, never a half directory.
    """
    gguf_file, out_dir = Path(gguf_file).absolute(), Path(out_dir).absolute()
    _check_out_dir(out_dir)
    header = read_gguf_header(gguf_file)
    tokenizer, loaded = _load_dequantized(gguf_file, header, dtype)
    model = _rebuild_without_quantization(loaded, dtype)
    model.generation_config = _generation_config(loaded.config, header)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _make_shareable(staging)
        # rename(2) replaces an empty directory atomically and fails on a non-empty one.
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _make_shareable(directory: Path) -> None:
    """mkdtemp creates 0700 and safetensors writes 0600; an imported model is read by every stage."""
    directory.chmod(0o755)
    for item in directory.iterdir():
        item.chmod(0o644)


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to overwrite anything: an import into a used directory is almost always a mistake."""
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFImportError(f"out_dir {out_dir} exists and is a file: choose a directory path")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise GGUFImportError(
            f"out_dir {out_dir} exists and is not empty: delete it to import again, or choose another out_dir"
        )


def _load_dequantized(
    gguf_file: Path, header: GGUFHeader, dtype: torch.dtype
) -> tuple[transformers.PreTrainedTokenizerBase, PreTrainedModel]:
    """Read tokenizer and model through transformers' GGUF loader, naming unsupported architectures."""
    directory, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    except ValueError as error:
        if "is not supported" not in str(error):
            raise
        supported = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - _NON_ARCHITECTURE_KEYS)
        raise GGUFImportError(
            f"{gguf_file} holds a {header.architecture!r} model, which the GGUF loader of transformers "
            f"{transformers.__version__} cannot read ({error}). It reads: {', '.join(supported)}. "
            "Use the model's Hugging Face safetensors release instead, or a GGUF of a supported architecture."
        ) from error
    return tokenizer, model


def _rebuild_without_quantization(loaded: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A plain model holding `loaded`'s weights, which `save_pretrained` accepts.

    The GGUF config carries a `quantization_config`; kept, it would make every later load try
    the GGUF quantizer again, so it is dropped. Building on the meta device skips a random
    initialization that `load_state_dict(assign=True)` would overwrite anyway.
    """
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    return model


def _generation_config(config: PretrainedConfig, header: GGUFHeader) -> GenerationConfig:
    """Generation defaults from the model config, stopping at every end-of-generation id."""
    generation_config = GenerationConfig.from_model_config(config)
    configured = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stop_ids = list(dict.fromkeys(i for i in [*configured, *header.end_of_generation_ids] if i is not None))
    if stop_ids:
        generation_config.eos_token_id = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    return generation_config
