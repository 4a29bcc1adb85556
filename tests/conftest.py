"""Shared pytest configuration: isolation from the user's home, the test tiers, and the fixture
families (each in its own module under tests/helpers/, named here).

Isolation: every test gets its own empty LAYERBUS_HOME, so no test reads what another run left
behind and nothing lands in ~/.local/share/layerbus. The default real model is the one thing
shared: it is prepared once into LAYERBUS_MODEL_CACHE, which points at $LAYERBUS_TEST_MODEL_CACHE
when set (run_tests.sh keeps it under .layerbus/ in the checkout) and at a session temporary
folder otherwise. Both are environment variables, so processes started by tests inherit them.

Tiers: the folders are the tiers, and the markers follow from them.
- tests/unit/: pure tests, no process started and no real model. A test there that comes out marked
  `cluster` or `slow` (by a mark or a fixture below) stops the collection, naming the folder it belongs in.
- tests/store/: the store's contract suite and every test run on both SQLite and PostgreSQL. The SQLite
  cases are unit tests; the PostgreSQL ones are `postgres` and `cluster` through their fixtures.
- tests/equivalence/: `slow`, every test: layerbus against references (transformers, lm-eval's HF
  backend, float32) and the checks that need the default real model. Those that start stage processes
  are `cluster` too, by their own mark (a module's `pytestmark`, or the test's).
- tests/cluster/: `cluster`, every test: tests that start processes (stages, brokers, CLI runs, Slurm,
  Prometheus, tmux...).
- tests/helpers/: what the tests share; no test.
Marks that follow from fixtures are added wherever the test is: the PostgreSQL fixtures (or the
`postgres` marker) imply `postgres` and `cluster`, the `default_model` fixture implies `slow`. The inner
loop is `pytest -m "not cluster and not slow"` (./run_tests.sh --fast): tests/unit and the SQLite half
of tests/store. A test outside `cluster` that starts a layerbus or PostgreSQL process fails, naming the
marker to add.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerbus.models.home import home_path
from layerbus.models.openmp_waits import prefer_passive_waits
from tests.helpers.run_shared import run_shared_dir

# The test workers compute references with torch beside the stage processes they start, as the CLI's
# processes do beside each other: their threads must not spin on the cores the others need
# (models/openmp_waits.py). Set before the fixture modules below import torch.
prefer_passive_waits()

pytest_plugins = [
    "tests.helpers.fixtures_models",
    "tests.helpers.fixtures_postgres",
]

TESTS = Path(__file__).resolve().parent
POSTGRES_FIXTURES = {"postgres_server", "postgres_url", "postgres_fresh_url"}
# Programs that make a process a cluster-tier one: the CLI, the local cluster script, a PostgreSQL server,
# a Slurm cluster (tests/helpers/slurm_cluster.py).
CLUSTER_PROGRAMS = {"layerbus", "run_cluster.sh", "initdb", "pg_ctl", "postgres",
                    "munged", "slurmctld", "slurmd", "sbatch"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    misplaced = []
    for item in items:
        folder = tier_folder(item)
        if folder == "cluster":
            item.add_marker(pytest.mark.cluster)
        elif folder == "equivalence":
            item.add_marker(pytest.mark.slow)
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & POSTGRES_FIXTURES:
            item.add_marker(pytest.mark.postgres)
        if item.get_closest_marker("postgres") is not None:
            item.add_marker(pytest.mark.cluster)
        if "default_model" in fixtures:
            item.add_marker(pytest.mark.slow)
        if folder == "unit" and (item.get_closest_marker("cluster") or item.get_closest_marker("slow")):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(f"{len(misplaced)} test(s) in tests/unit/ start processes or use the default model "
                                f"(marked cluster or slow): move them to tests/cluster/ or tests/equivalence/: "
                                f"{misplaced[:5]}")


def tier_folder(item: pytest.Item) -> str | None:
    """The tier folder a test sits in (unit, store, equivalence, cluster), None outside tests/."""
    path = Path(item.path)
    return path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None


def is_cluster_command(words: list[str]) -> bool:
    """True for `python -m layerbus...` and for the programs in CLUSTER_PROGRAMS, wherever they live."""
    modules = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "-m"]
    return (any(m == "layerbus" or m.startswith("layerbus.") for m in modules)
            or any(Path(word).name in CLUSTER_PROGRAMS for word in words))


@pytest.fixture(scope="session", autouse=True)
def _session_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """LAYERBUS_MODEL_CACHE for the whole session: never the user's real cache."""
    given = os.environ.get("LAYERBUS_TEST_MODEL_CACHE")
    cache = Path(given).resolve() if given else tmp_path_factory.mktemp("model_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERBUS_MODEL_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session", autouse=True)
def _session_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache of stage measurements for the session (LAYERBUS_PROFILE_CACHE): stages on the same
    tiny model, dtype and threads are profiled once, and stages sharing the machine probed once, not
    again in every test's empty home (together 5 to 15 s of every cluster test that plans). Entries are
    keyed by model path and config hash, so tests never share a profile of different models. A test
    of the cache itself unsets it and reads its own. Shared by the run's xdist workers (each measured
    once per run, not once per worker); entries are written to a temporary name and renamed, so a
    worker never reads another's half-written file."""
    cache = run_shared_dir(tmp_path_factory, "profiles")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERBUS_PROFILE_CACHE", str(cache))
        # The compiled block kernel likewise: built once per session, not by every quantized stage's home.
        patch.setenv("LAYERBUS_KERNEL_CACHE", str(run_shared_dir(tmp_path_factory, "kernels")))
        yield cache


def _home_snapshot(home: Path) -> dict[str, float]:
    """Path -> mtime of everything in the top two levels of a layerbus home (where every file that
    layerbus writes lands: the store, profiles/*.json, runs/*.json, results/*, logs/<job>/, models/*)."""
    entries = [*home.glob("*"), *home.glob("*/*")] if home.is_dir() else []
    return {str(path): path.stat().st_mtime for path in entries if path.exists()}


@pytest.fixture(scope="session", autouse=True)
def _session_layerbus_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """LAYERBUS_HOME for what runs before any test's own home is set (module- and session-scoped
    fixtures that start clusters), and a check at the end that the real home was left alone."""
    real = home_path(os.environ)
    before = _home_snapshot(real)
    home = tmp_path_factory.mktemp("session_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERBUS_HOME", str(home))
        yield home
    touched = sorted(path for path, mtime in _home_snapshot(real).items() if before.get(path) != mtime)
    if touched:
        pytest.fail(f"the test session wrote into the real LAYERBUS_HOME {real}: {touched[:5]}; a test or fixture "
                    f"ran without the per-test home (tests/conftest.py)", pytrace=False)


@pytest.fixture(autouse=True)
def _own_layerbus_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty LAYERBUS_HOME for each test (a test may still point it elsewhere)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("LAYERBUS_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def _cluster_processes_need_the_marker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the `cluster` tier, starting a layerbus or PostgreSQL process fails the test."""
    if request.node.get_closest_marker("cluster") is not None:
        return
    original = subprocess.Popen.__init__

    def guarded(self, args, *more, **kwargs):  # type: ignore[no-untyped-def]
        words = str(args).split() if isinstance(args, (str, bytes, os.PathLike)) else [str(a) for a in args]
        if is_cluster_command(words):
            pytest.fail(f"{request.node.nodeid} starts {' '.join(words)!r}: tests that start processes belong to "
                        f"the cluster tier: move them to tests/cluster/, or (in tests/store/ and "
                        f"tests/equivalence/) mark them `pytest.mark.cluster`", pytrace=False)
        original(self, args, *more, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
