"""deploy/: the systemd units pass `systemd-analyze verify` without a warning, the options their example
environment files give are ones `layerbus broker` / `layerbus stage` accept, and the sbatch script refuses to
run outside Slurm with a message saying how. (tests/test_slurm.py runs the sbatch script on real Slurm.)"""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from layerbus.cli.main import build_parser
from layerbus.cli.stage import stage_parser
from tests.test_cli_helpers import REPO, layerbus_executable

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
