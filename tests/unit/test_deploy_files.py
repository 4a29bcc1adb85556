"""deploy/: the systemd units pass `systemd-analyze verify` without a warning, the options their example
environment files give are ones `layerbus broker` / `layerbus stage` accept; the sbatch script refuses to run
outside Slurm with a message saying how, and under a fake `srun` (tasks on nodes with GPUs, which this machine
lacks) gives each stage task the GPU of its rank on its node. tests/cluster/test_slurm.py runs it on real Slurm."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from layerbus.cli.main import build_parser
from layerbus.cli.stage import stage_parser
from tests.helpers.cli import REPO, layerbus_executable

SYSTEMD = REPO / "deploy" / "systemd"
SBATCH = REPO / "deploy" / "slurm" / "layerbus.sbatch"


def example_options(name: str) -> dict[str, list[str]]:
    """VAR -> its words, from an example environment file's lines, commented-out ones included."""
    found = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        line = line.removeprefix("# ")
        name_, sep, value = line.partition("=")
        if sep and name_.startswith("LAYERBUS_") and name_.isupper():
            found[name_] = shlex.split(value)
    return found


def test_the_example_options_are_ones_the_cli_accepts():
    parser = build_parser()
    broker = example_options("broker.env.example")["LAYERBUS_BROKER_OPTIONS"]
    assert parser.parse_args(["broker", *broker]).stages == 4
    stage = example_options("stage.env.example")
    args = stage_parser().parse_args(["--name", "gpu-box-0", *stage["LAYERBUS_STAGE_OPTIONS"],
                                      *stage["LAYERBUS_STAGE_INSTANCE_OPTIONS"]])
    assert args.device == "cuda:0" and args.broker == "tcp://broker-host:5555"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze (the systemd package)")
@pytest.mark.parametrize("unit, instance", [("layerbus-broker@.service", "main"), ("layerbus-stage@.service", "0")])
def test_the_systemd_units_verify_without_a_warning(tmp_path, unit, instance):
    # The units as installed, but pointing at this checkout's layerbus and a folder of environment files here.
    text = (SYSTEMD / unit).read_text()
    assert "/srv/layerbus/.venv/bin/layerbus" in text and "/etc/layerbus/" in text
    text = text.replace("/srv/layerbus/.venv/bin/layerbus", layerbus_executable())
    (tmp_path / unit.replace("@", f"@{instance}")).write_text(text.replace("/etc/layerbus/", f"{tmp_path}/"))
    verified = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit.replace("@", f"@{instance}"))],
                              capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0 and not (verified.stdout + verified.stderr).strip(), verified.stderr


def test_the_sbatch_script_outside_slurm_says_how_to_run_it(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    ran = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)
    assert ran.returncode == 2 and "submit it with sbatch" in ran.stderr
    no_store = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, cwd=tmp_path, timeout=30,
                              env={**env, "SLURM_JOB_ID": "7", "SLURM_NTASKS": "3", "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert no_store.returncode == 2 and "LAYERBUS_DB is not set" in no_store.stderr
    too_few = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, cwd=tmp_path, timeout=30,
                             env={**env, "SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_SUBMIT_DIR": str(tmp_path),
                                  "LAYERBUS_DB": "sqlite:///x.db"})
    assert too_few.returncode == 2 and "--ntasks=3: 2 stages" in too_few.stderr


FAKE_SRUN = """#!/usr/bin/env bash
# srun for a layout of FAKE_LAYOUT="NODE:LOCALID ..." (one word per task): runs the command once per task, in turn.
while [[ "$1" == --* ]]; do shift; done
code=0 procid=0
for place in $FAKE_LAYOUT; do
    SLURM_PROCID=$procid SLURM_NODEID=${place%%:*} SLURM_LOCALID=${place##*:} "$@" || code=$?
    procid=$(( procid + 1 ))
done
exit $code
"""
# layerbus for the sbatch script: `keys new DIR` makes the files, anything else says what it was asked.
FAKE_LAYERBUS = """#!/usr/bin/env bash
if [[ "$1" == keys ]]; then mkdir -p "$3" && touch "$3/broker.key" "$3/broker.key_secret"; exit 0; fi
echo "task $SLURM_PROCID: $*"
"""


def run_with_fake_slurm(tmp_path, layout: str, gpus: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("layerbus", FAKE_LAYERBUS)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "7",
           "SLURM_NTASKS": str(len(layout.split())), "SLURM_SUBMIT_DIR": str(tmp_path), "FAKE_LAYOUT": layout,
           "LAYERBUS_DB": "sqlite:///jobs.db", "LAYERBUS": str(bin_dir / "layerbus"), "CUDA_VISIBLE_DEVICES": gpus}
    return subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)


def devices(stdout: str) -> dict[int, str]:
    found = {}
    for line in stdout.splitlines():
        task, _, command = line.partition(": ")
        words = command.split()
        if "stage" in words:
            found[int(task.split()[1])] = words[words.index("--device") + 1]
    return found


@pytest.mark.parametrize("layout, gpus, expected", [
    # one node, 2 GPUs: the broker is task 0, stage tasks 1 and 2 take GPUs 0 and 1
    ("0:0 0:1 0:2", "0,1", {1: "cuda:0", 2: "cuda:1"}),
    # two nodes of 2 GPUs: node 0 holds the broker and 2 stages, node 1 two stages, each numbered from its GPU 0
    ("0:0 0:1 0:2 1:0 1:1", "0,1", {1: "cuda:0", 2: "cuda:1", 3: "cuda:0", 4: "cuda:1"}),
    ("0:0 0:1 0:2", "", {1: "cpu", 2: "cpu"}),  # no GPUs allocated: CPU stages
])
def test_each_stage_task_takes_the_gpu_of_its_rank_on_its_node(tmp_path, layout, gpus, expected):
    ran = run_with_fake_slurm(tmp_path, layout, gpus)
    assert ran.returncode == 0, ran.stderr
    assert devices(ran.stdout) == expected
    assert "task 0: -v broker --exit-when-idle --stages" in ran.stdout
    assert not list(tmp_path.glob(".layerbus-slurm-*")), "the job's keys are removed at the end"


def test_more_stage_tasks_on_a_node_than_gpus_is_refused_with_the_fix(tmp_path):
    ran = run_with_fake_slurm(tmp_path, "0:0 0:1 0:2 0:3", "0,1")
    assert devices(ran.stdout) == {1: "cuda:0", 2: "cuda:1"}
    assert "stage task 3 is stage 3 on" in ran.stderr and "one stage task per GPU" in ran.stderr
