"""Stage profiles for planned placement, without stage processes: the planner gives a five times slower stage
fewer layers, the profile cache is reused and an emulated speed divides the measurement, a profile is taken in
the stage's weight format; memory budget sizes and stage flags parsed. tests/cluster/test_placement_cluster.py
places a model from real stages' profiles."""

from __future__ import annotations

import json

import pytest

from layerbus.planner.model_memory import model_memory
from layerbus.planner.placement import PlanOptions, StageProfile, plan_placement
from layerbus.planner.batching import BatchingConfig
from layerbus.models.model_files import open_model_dir
from layerbus.stages.host import current_rss_bytes
from layerbus.wire.frames import WireError
from layerbus.stages.profile import TIMING_FIELDS, ProfileRequest, emulated_timings, profile_stage


def test_planner_gives_a_five_times_slower_stage_fewer_layers(tiny_models) -> None:
    """The decision the end-to-end test relies on, from profiles as the two stages report them."""
    model_dir = tiny_models("llama", num_hidden_layers=8, hidden_size=128, intermediate_size=512)
    measured = {"layer_decode_s": 0.4e-3, "layer_prefill_s": 1.5e-3, "embed_s": 0.05e-3, "head_s": 0.3e-3,
                "step_overhead_s": 0.6e-3}  # a tiny model's figures on one CPU thread

    def profile(name: str, speed: float) -> StageProfile:
        return StageProfile(name=name, memory_budget=2**33, micro_batch_size=8, prefill_tokens=256,
                            **emulated_timings(measured, speed))

    plan = plan_placement([profile("stage-0", 0.2), profile("stage-1", 1.0)], model_memory(open_model_dir(model_dir)),
                          BatchingConfig(num_slots=8, max_context=64), PlanOptions(allow_drop=False))
    layers = {stage.name: len(stage.layers) for stage in plan.stages}
    assert layers["stage-0"] < layers["stage-1"] and sum(layers.values()) == 8, layers


def test_profile_cache_is_reused_and_emulated_speed_divides_the_measurement(tiny_models, tmp_path,
                                                                            monkeypatch) -> None:
    request = ProfileRequest(str(tiny_models("llama")), micro_batch_size=4, kv_length=16, prefill_tokens=16)
    first = profile_stage(request, "cpu", "float32", 1, cache_dir=tmp_path)
    again = profile_stage(request, "cpu", "float32", 1, cache_dir=tmp_path)
    slower = profile_stage(request, "cpu", "float32", 1, emulate_speed=0.5, cache_dir=tmp_path)
    assert not first["cached"] and again["cached"] and slower["cached"]
    with monkeypatch.context() as spinning:  # a step timed while threads spin is not one timed while they sleep
        spinning.setenv("OMP_WAIT_POLICY", "ACTIVE")
        assert not profile_stage(request, "cpu", "float32", 1, cache_dir=tmp_path)["cached"]
    for field in TIMING_FIELDS:
        assert again[field] == first[field]
        assert slower[field] == first[field] / 0.5  # applied to the one measurement, not measured again
    (tmp_path / "junk.json").write_text("not json")
    for path in tmp_path.glob("*.json"):
        path.write_text("{broken")
    assert not profile_stage(request, "cpu", "float32", 1, cache_dir=tmp_path)["cached"]  # a bad file is re-measured
    assert profile_stage(request, "cpu", "float32", 1, emulate_memory=12345, cache_dir=tmp_path)["memory_budget"] == 12345
    # The whole stage's memory: less its runtime, and the loader's transient
    runtime = current_rss_bytes() + (400 << 20)  # more than this process holds: counted as given
    given = profile_stage(request, "cpu", "float32", 1, memory_budget=4 << 30, runtime_bytes=runtime, cache_dir=tmp_path)
    assert given["runtime_bytes"] == runtime
    assert given["memory_budget"] == (4 << 30) - runtime - given["loader_peak_bytes"]
    # Less than this process holds after timing layers: what it holds is the runtime (what a load starts from)
    held = profile_stage(request, "cpu", "float32", 1, memory_budget=4 << 30, runtime_bytes=1 << 20, cache_dir=tmp_path)
    assert held["runtime_bytes"] > 1 << 20
    assert held["memory_budget"] == (4 << 30) - held["runtime_bytes"] - held["loader_peak_bytes"]


def test_profile_is_taken_in_the_stage_s_weight_format_and_auto_times_the_fallbacks(tiny_models, tmp_path) -> None:
    """Under auto the profile is full precision with each quantized fallback timed beside it (a ratio
    per shape); a stage whose own --weights is int4 is timed holding int4, in a cache entry of its own,
    with no ratios; the broker's format reaches a stage without its own flag."""
    model = str(tiny_models("llama"))
    auto = ProfileRequest(model, micro_batch_size=4, kv_length=16, prefill_tokens=16)
    full = profile_stage(auto, "cpu", "float32", 1, cache_dir=tmp_path)
    assert full["weights_profiled"] == "auto"
    assert set(full["format_ratios"]) == {"int8", "int4"}
    assert all(set(r) == {"decode", "prefill"} and all(v > 0 for v in r.values()) for r in full["format_ratios"].values())
    own = profile_stage(auto, "cpu", "float32", 1, cache_dir=tmp_path, own_weights="int4")
    assert not own["cached"] and own["weights_profiled"] == "int4" and own["format_ratios"] == {}
    from_broker = profile_stage(ProfileRequest(model, 4, 16, 16, weights="int4"), "cpu", "float32", 1,
                                cache_dir=tmp_path)
    assert from_broker["cached"] and from_broker["weights_profiled"] == "int4"
    assert profile_stage(ProfileRequest(model, 4, 16, 16, weights="int4"), "cpu", "float32", 1, cache_dir=tmp_path,
                         own_weights="fp32")["weights_profiled"] == "fp32"  # the stage's own flag wins
    with pytest.raises(WireError, match="profile weights must be one of"):
        ProfileRequest.from_header({"model_dir": model, "micro_batch_size": 4, "kv_length": 16, "prefill_tokens": 16,
                                    "weights": "int3"})
    # A cache entry whose ratios are damaged is measured again
    for path in tmp_path.glob("*.json"):
        stored = json.loads(path.read_text())
        if stored["key"]["weights"] == "auto":
            stored["format_ratios"]["int4"]["decode"] = -1
            path.write_text(json.dumps(stored))
    assert not profile_stage(auto, "cpu", "float32", 1, cache_dir=tmp_path)["cached"]


@pytest.mark.parametrize("text, expected", [("1500", 1500), ("300MB", 300_000_000), ("1.5GiB", 1.5 * 2**30),
                                            ("64 KiB", 65536)])
def test_memory_budget_sizes(text: str, expected: float) -> None:
    from layerbus.stages.__main__ import byte_size

    assert byte_size(text) == int(expected)


@pytest.mark.parametrize("argv, message", [(["--memory-budget", "3 bananas"], "is not a size"),
                                           (["--emulate-speed", "0"], "0 < F <= 1"),
                                           (["--emulate-speed", "1.5"], "0 < F <= 1"),
                                           (["--emulate-speed", "-0.3"], "0 < F <= 1")])
def test_stage_flags_reject_bad_values(argv, message, capsys) -> None:
    from layerbus.stages.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--broker", "tcp://127.0.0.1:1", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
