"""A compressed-tensors checkpoint (`pack-quantized`, 4-bit symmetric groups of 32) made from a tiny
random model: each decoder projection's weight quantized here and packed with the library's own
`pack_to_int32`, the rest kept, and the `quantization_config` transformers reads to load it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_compressed_checkpoint(model_dir: Path, out_dir: Path) -> Path:
    from compressed_tensors.compressors import pack_to_int32

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            shutil.copy2(item, out_dir / item.name)
    tensors = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            base = name[: -len("weight")]
            rows, cols = tensor.shape
            groups = tensor.float().reshape(rows, cols // GROUP, GROUP)
            # Scales that float16 holds exactly, stored as float32: dequantizing is exact in either
            scale = (groups.abs().amax(-1) / 7).clamp_min(1e-6).to(torch.float16).to(torch.float32)
            quants = torch.round(groups / scale[..., None]).clamp(-8, 7).to(torch.int8).reshape(rows, cols)
            tensors[base + "weight_packed"] = pack_to_int32(quants, 4)
            tensors[base + "weight_scale"] = scale
            tensors[base + "weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        else:
            tensors[name] = tensor
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
            "dynamic": False, "actorder": None, "observer": "minmax"}, "input_activations": None,
            "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
