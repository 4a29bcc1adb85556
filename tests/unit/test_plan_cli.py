"""`layerbus plan --cluster FILE`: the printed and JSON plans, and one clear message per bad file."""

from __future__ import annotations

import json

import pytest

from layerbus.cli.main import main

CLUSTER_TOML = """
reference_gflops = 10
[[stages]]
name = "fast"
speed = 3.0
memory = "64MiB"
[[stages]]
name = "slow"
speed = 1.0
memory = "64MiB"
link_bandwidth = "1GB"
"""


@pytest.fixture()
def model_dir(tiny_models):
    return tiny_models("llama", num_hidden_layers=8)


def run_plan(capsys, model_dir, *argv) -> tuple[int, str, str]:
    code = main(["plan", "--model", str(model_dir), "--max-context", "64", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_from_a_toml_file_prints_both_splits_and_explains(tmp_path, capsys, model_dir) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(path), "--explain")
    assert code == 0
    assert "planned:" in out and "equal split:" in out and "tok/s predicted" in out
    assert "why each stage leaves memory unused" in out and "reserve" in out


def test_plan_json_gives_the_slow_stage_fewer_layers(tmp_path, capsys, model_dir) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"stages": [{"name": "fast", "speed": 3, "memory": 2**26},
                                           {"name": "slow", "speed": 1, "memory": "64MiB"}]}))
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(path), "--json", "--prompt-ratio", "0")
    assert code == 0
    plan = json.loads(out)
    layers = {s["name"]: s["num_layers"] for s in plan["chosen"]["stages"]}
    assert layers["slow"] < layers["fast"] and sum(layers.values()) == 8
    assert plan["chosen"]["tokens_per_s"] >= plan["equal"]["tokens_per_s"]


HOSTS_TOML = """
[network]
host_bandwidth = "5GB"
broker_host = "boxA"
[[links]]
between = ["boxA", "boxB"]
bandwidth = "80MB"
latency_ms = 0.5
""" + "".join(f"""
[[stages]]
name = "{name}"
host = "box{name[0].upper()}"
speed = 1.0
memory = "64MiB"
""" for name in ("a0", "b0", "a1", "b1"))


def test_plan_explain_draws_the_chain_over_hosts_crossing_the_slow_link_once(tmp_path, capsys, model_dir) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(HOSTS_TOML)
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(path), "--explain", "--keep-all")
    assert code == 0
    links = [line for line in out.splitlines() if " -> " in line and "[box" in line]
    assert sum("crosses hosts, 80.0 MB/s" in line for line in links) == 1, out
    assert any(line.startswith("  broker [boxA] -> a") for line in links), out
    assert "order searched: exact" in out and "ignoring the network the planner would choose a0 [0," in out
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(path), "--json", "--keep-all")
    plan = json.loads(out)
    hosts = [s["host"] for s in plan["chosen"]["stages"]]
    assert sorted(hosts) == ["boxA", "boxA", "boxB", "boxB"] and hosts[0] == hosts[1] and hosts[2] == hosts[3]
    assert plan["ignoring_network"]["tokens_per_s"] < plan["chosen"]["tokens_per_s"]


BAD_FILES = {
    "unknown field": ('{"stages": [{"name": "a", "speed": 1, "memory": 1000000, "sped": 2}]}', "unknown field(s) ['sped']"),
    "negative speed": ('{"stages": [{"name": "a", "speed": -1, "memory": 1000000}]}', "speed must be > 0"),
    "no memory": ('{"stages": [{"name": "a", "speed": 1}]}', "'memory' is required"),
    "speed and times": ('{"stages": [{"name": "a", "speed": 1, "layer_decode_ms": 2, "memory": 10}]}', "not both"),
    "bad size": ('{"stages": [{"name": "a", "speed": 1, "memory": "lots"}]}', "is not a size"),
    "not json": ("stages = [", "is not valid JSON"),
    "no stages": ('{"stages": []}', "non-empty 'stages' list"),
    "duplicate names": ('{"stages": [{"name": "a", "speed": 1, "memory": 10}, {"name": "a", "speed": 1, "memory": 10}]}',
                        "unique"),
    "too small": ('{"stages": [{"name": "a", "speed": 1, "memory": 1000}]}', "bytes"),
}


@pytest.mark.parametrize("text, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_cluster_files_get_one_clear_message(tmp_path, capsys, model_dir, text: str, message: str) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(text)
    code, out, err = run_plan(capsys, model_dir, "--cluster", str(path))
    assert code == 2
    assert message in err and "Traceback" not in err


def test_bad_toml_and_missing_file(tmp_path, capsys, model_dir) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text("[[stages]\nname=")
    assert run_plan(capsys, model_dir, "--cluster", str(path))[2].count("is not valid TOML") == 1
    code, _, err = run_plan(capsys, model_dir, "--cluster", str(tmp_path / "missing.toml"))
    assert code == 2 and "cannot read cluster file" in err


def quality_report(model_dir, kl: float = 0.0042, same_top: float = 0.971) -> dict:
    """What `layerbus quality --json` prints, cut to what `plan --quality` reads."""
    return {"model": str(model_dir), "corpus": "/data/my_corpus", "cuts": [4], "prompts": 3,
            "reference": {"weights": "fp32", "wire": "float32"},
            "pairs": [{"weights": "fp32", "wire": "float32", "mean_kl": 0.0, "same_top": 1.0},
                      {"weights": "int8", "wire": "float32", "mean_kl": kl, "same_top": same_top},
                      {"weights": "int8", "wire": "int8", "mean_kl": 0.5, "same_top": 0.5}]}


def test_plan_reads_the_model_s_own_quality_report(tmp_path, capsys, model_dir) -> None:
    """A stage held in int8 is explained with the quality the given report measured for this model (its
    float32-wire pair), in the text and in JSON; without --quality, the built-in SmolLM2 figures."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CLUSTER_TOML.replace('name = "slow"', 'name = "slow"\nweights = "int8"'))
    report = tmp_path / "quality.json"
    report.write_text(json.dumps(quality_report(model_dir)))
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(cluster), "--explain", "--quality", str(report))
    assert code == 0
    assert f"KL 0.0042, same top token 97.1% ({model_dir.name}, my_corpus, {report})" in out
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(cluster), "--json", "--quality", str(report))
    stages = {s["name"]: s for s in json.loads(out)["chosen"]["stages"]}
    assert stages["slow"]["quality_vs_float32"]["mean_kl"] == 0.0042
    assert stages["fast"]["quality_vs_float32"] is None  # full precision costs nothing
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(cluster), "--explain")
    assert "KL 0.0013, same top token 98.1% (SmolLM2-135M, sample corpus)" in out


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ("{not json", "not JSON"),
    (json.dumps({"pairs": []}), "not a `layerbus quality --json` report"),
    ("OTHER", "measured on SmolLM2-135M-Instruct, not on"),
    ("NOWIRE", "no pair on the float32 wire"),
    ("BADKL", "has no numeric mean_kl and same_top"),
])
def test_a_bad_quality_report_is_refused_before_any_profiling(tmp_path, capsys, model_dir, content, message) -> None:
    report = tmp_path / "quality.json"
    data = quality_report(model_dir)
    if content == "OTHER":
        content = json.dumps(dict(data, model="/models/SmolLM2-135M-Instruct"))
    elif content == "NOWIRE":
        content = json.dumps(dict(data, pairs=[p for p in data["pairs"] if p["wire"] != "float32"]))
    elif content == "BADKL":
        content = json.dumps(dict(data, pairs=[dict(data["pairs"][1], mean_kl="low")]))
    if content is not None:
        report.write_text(content)
    code, _, err = run_plan(capsys, model_dir, "--stages", "2", "--quality", str(report))
    assert code == 2
    assert message in err and "quality" in err


def test_plan_shows_the_chains_the_stages_form_beside_one_chain(tmp_path, capsys, model_dir) -> None:
    # Four alike stages on machines of their own, each able to hold the tiny model alone: one chain of
    # four, two of two, ... are each priced; the choice is marked and comes with its gain over one chain.
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"stages": [{"name": f"s{i}", "speed": 1, "memory": 2**26, "host": f"box{i}"}
                                           for i in range(4)]}))
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(path), "--json")
    assert code == 0
    chains = json.loads(out)["chains"]
    assert [row["chains"] for row in chains["by_count"]] == [1, 2, 3, 4]
    assert chains["single"]["chains"] == 1 and chains["chosen"]["tokens_per_s"] >= chains["single"]["tokens_per_s"]
    assert sorted(name for group in chains["chosen"]["groups"] for name in group) == ["s0", "s1", "s2", "s3"]
    code, out, _ = run_plan(capsys, model_dir, "--cluster", str(path), "--chains", "2")
    assert code == 0
    assert "chains (each holds the whole model" in out and " * 2 chain(s):" in out and "chosen: 2 chains" in out
    code, _, err = run_plan(capsys, model_dir, "--cluster", str(path), "--chains", "5")
    assert code != 0 and "--chains 5" in err and "use --chains 4 or fewer" in err


def test_no_keep_caches_plans_no_memory_for_what_stages_send(tmp_path, capsys, model_dir) -> None:
    """Every stage but the last keeps what it sends (for a replay after a re-plan); --no-keep-caches
    plans that memory away and only that."""
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    plans = {}
    for flag in ((), ("--no-keep-caches",)):
        code, out, _ = run_plan(capsys, model_dir, "--cluster", str(path), "--json", "--keep-all", "--slots", "4", *flag)
        assert code == 0
        plans[bool(flag)] = {s["name"]: s for s in json.loads(out)["chosen"]["stages"]}
    kept, not_kept = plans[False], plans[True]
    for name, stage in kept.items():
        if stage["head"]:
            assert stage["kv_bytes"] == not_kept[name]["kv_bytes"]
        else:  # 4 slots x 64 positions (+ the prefix cache's) x the tiny model's hidden state in float32
            assert stage["kv_bytes"] > not_kept[name]["kv_bytes"]
