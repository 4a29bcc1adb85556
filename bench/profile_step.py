"""Where one stage's decode step spends its time, in process: layerbus's forward and token pick against
`transformers`' own forward with its KV cache, then torch's profiler over two of layerbus's steps.

Made for a GPU, where a small model's step is bound by the CPU launching kernels, not by the device:

    .venv/bin/python bench/profile_step.py --device cuda:0 --dtype bfloat16 --rows 256
    .venv/bin/python bench/profile_step.py --device cpu --dtype float32 --rows 64        # a dry run here

`--random-weights` builds a model with the default model's config and tokenizer and seeded random
weights (for a machine the default model cannot reach); the step's cost does not depend on the weights.
Prints timings and the profiler's tables; writes nothing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from layerbus.models.openmp_waits import prefer_passive_waits  # noqa: E402

prefer_passive_waits()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerbus.models.attention_shape import attention_shape  # noqa: E402
from layerbus.models.model_files import open_model_dir  # noqa: E402
from layerbus.stages.forward import run_step  # noqa: E402
from layerbus.stages.kv_cache import KVArena  # noqa: E402
from layerbus.stages.profile_timing import synchronizer  # noqa: E402
from layerbus.stages.sampling import last_stage_outputs  # noqa: E402
from layerbus.stages.shard import ShardSpec, load_shard  # noqa: E402
from layerbus.wire.protocol import StepRow  # noqa: E402
from layerbus.wire.spans import LayerRange  # noqa: E402

PROMPT_TOKENS = 60  # every slot's cached context before the timed steps


def random_weights_model(source: Path, target: Path) -> Path:
    """A model with `source`'s config and tokenizer and seeded random weights, saved in `target`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    return target


class DecodeSteps:
    """One stage holding every layer, its slots filled with PROMPT_TOKENS each, stepping all of them."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: str, rows: int):
        files = open_model_dir(model_dir)
        self.shard = load_shard(files, ShardSpec(LayerRange(0, files.num_layers), True, True, device=str(device),
                                                 dtype=dtype))
        shape = attention_shape(self.shard.config)
        self.arena = KVArena(list(range(files.num_layers)), rows, shape.kv_heads, shape.head_dim, self.shard.dtype,
                             self.shard.device, 4 * PROMPT_TOKENS, initial_capacity=2 * PROMPT_TOKENS)
        self.rows, self.position = rows, PROMPT_TOKENS
        for first in range(0, rows, 16):
            count = min(16, rows - first)
            run_step(self.shard, self.arena, [StepRow(slot, 0, PROMPT_TOKENS) for slot in range(first, first + count)],
                     torch.ones(count * PROMPT_TOKENS, dtype=torch.long))

    def step(self, pick: bool = True):
        if self.position >= self.arena.max_context:  # rewind every slot rather than outgrow the arena
            self.position = PROMPT_TOKENS
        rows = [StepRow(slot, self.position, 1, emit=True) for slot in range(self.rows)]
        self.position += 1
        hidden = run_step(self.shard, self.arena, rows, torch.ones(self.rows, dtype=torch.long))
        return last_stage_outputs(self.shard, rows, hidden) if pick else hidden


def timed(label: str, step, device: torch.device, count: int = 10) -> float:
    sync = synchronizer(device)
    for _ in range(3):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(count):
        step()
    sync()
    ms = 1000 * (time.perf_counter() - started) / count
    print(f"{label}: {ms:.1f} ms/step", flush=True)
    return ms


def hf_step(model_dir: Path, device: torch.device, dtype: str, rows: int):
    """`transformers`' forward over the same rows with its own KV cache, and the same greedy pick."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.no_grad():
        cache = model(torch.ones(rows, PROMPT_TOKENS, dtype=torch.long, device=device), use_cache=True).past_key_values
    length = [PROMPT_TOKENS]

    @torch.no_grad()
    def step():
        length[0] += 1
        out = model(torch.ones(rows, 1, dtype=torch.long, device=device),
                    attention_mask=torch.ones(rows, length[0], dtype=torch.long, device=device),
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float().log_softmax(-1).max(-1).indices.tolist()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the default model)")
    parser.add_argument("--random-weights", action="store_true", help="the model's config with seeded random weights")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rows", type=int, default=256, help="decode rows per step")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.model is None:
        from layerbus.models.default_model import default_model_dir
        args.model = default_model_dir()
    with tempfile.TemporaryDirectory(prefix="layerbus-profile-") as scratch:
        model_dir = random_weights_model(args.model, Path(scratch)) if args.random_weights else args.model
        steps = DecodeSteps(model_dir, device, args.dtype, args.rows)
        timed(f"layerbus forward, {args.rows} decode rows", lambda: steps.step(pick=False), device)
        timed("layerbus forward + token pick", steps.step, device)
        timed("transformers forward + the same pick", hf_step(model_dir, device, args.dtype, args.rows), device)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as profiler:
            for _ in range(2):
                steps.step()
            synchronizer(device)()
    events = profiler.key_averages()
    print("aten calls per layerbus step:", sum(e.count for e in events if e.key.startswith("aten::")) // 2)
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if device.type == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
