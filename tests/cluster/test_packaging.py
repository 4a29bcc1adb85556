"""The built wheel installs one import name, `layerbus`, and nothing else into site-packages.

Generic top-level names (`broker`, `storage`, `jobs`...) would overwrite or be shadowed by other
distributions and by a user's own folders; this builds the real wheel and installs it into a fresh
virtual environment to prove they are gone and the console script still works.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    # Built from a copy of what the wheel is made of: pip builds in the source tree, and its build/
    # folder must not be left in the repository.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in package_dir.values():
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation: the test venv has setuptools, and CI should not depend on fetching it again.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", str(source), "-w", str(out)], check=True, cwd=out)
    (built,) = out.glob("layerbus-*.whl")
    return built


def test_wheel_holds_only_the_layerbus_package(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    stray = [n for n in names if not n.startswith("layerbus/") and not n.split("/")[0].endswith(".dist-info")]
    assert not stray, f"files outside layerbus/ in {wheel.name}: {stray[:10]}"
    packages = {n.split("/")[1] for n in names if n.startswith("layerbus/") and n.count("/") >= 2}
    assert {"broker", "stages", "jobs", "storage", "wire", "cli"} <= packages


def test_installed_wheel_has_no_generic_top_level_names(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # --no-deps: `layerbus --help` must work without torch and friends, which keeps this test fast.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True)
    for generic in ("broker", "stages", "jobs", "storage", "wire", "cli"):
        probe = subprocess.run([str(python), "-c", f"import {generic}"], cwd=tmp_path, capture_output=True, text=True)
        assert probe.returncode != 0, f"`import {generic}` worked in a clean venv with only the layerbus wheel"
        assert "ModuleNotFoundError" in probe.stderr
    helped = subprocess.run([str(env_dir / "bin" / "layerbus"), "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr
    assert "usage: layerbus" in helped.stdout


def test_the_lm_eval_adapter_is_an_extra_and_says_how_to_install_it(wheel: Path, tmp_path: Path):
    metadata = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Provides-Extra: lm-eval" in text and "extra == \"lm-eval\"" in text
    assert not [line for line in text.splitlines() if line.startswith("Requires-Dist: lm-eval") and "extra ==" not in line]
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True)
    probe = subprocess.run([str(python), "-c", "import layerbus.evals.lm_eval_adapter"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "pip install 'layerbus[lm-eval]'" in probe.stderr, probe.stderr
