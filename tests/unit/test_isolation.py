"""The test suite's own hygiene (tests/conftest.py): each test has its own empty LAYERBUS_HOME, the model cache
is not the user's, and a test that starts layerbus processes must be in the cluster tier.
tests/cluster/test_isolation.py checks that a CLI process leaves the user's real home alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerbus.models.default_model import model_cache_dir
from layerbus.storage.locations import layerbus_home
from tests.conftest import is_cluster_command

REAL_DEFAULT_HOME = Path.home() / ".local" / "share" / "layerbus"


def test_layerbus_home_is_this_tests_own_and_empty(tmp_path_factory: pytest.TempPathFactory) -> None:
    home = layerbus_home()
    assert home.is_relative_to(tmp_path_factory.getbasetemp()), home
    assert list(home.iterdir()) == [], "another test or run left files in this test's home"


def test_the_model_cache_is_not_the_users(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = model_cache_dir()
    assert not cache.resolve().is_relative_to(REAL_DEFAULT_HOME.resolve()), cache
    given = os.environ.get("LAYERBUS_TEST_MODEL_CACHE")  # run_tests.sh keeps one in the checkout
    if given:
        assert cache == Path(given).resolve()
    else:
        assert cache.is_relative_to(tmp_path_factory.getbasetemp()), cache


COMMANDS = {
    "stage module": ([sys.executable, "-m", "layerbus.stages", "--broker", "tcp://127.0.0.1:1"], True),
    "the CLI module": ([sys.executable, "-m", "layerbus"], True),
    "console script": (["/opt/venv/bin/layerbus", "run", "x.jsonl"], True),
    "run_cluster.sh": (["bash", "/src/layerbus/run_cluster.sh", "stage"], True),
    "PostgreSQL": (["runuser", "-u", "postgres", "--", "/usr/lib/postgresql/16/bin/initdb", "-D", "d"], True),
    "a Python snippet in a checkout named layerbus": (["/home/u/layerbus/.venv/bin/python", "-c", "print(1)"], False),
    "ip": (["ip", "netns", "list"], False),
}


@pytest.mark.parametrize("words, expected", COMMANDS.values(), ids=COMMANDS.keys())
def test_cluster_commands_are_recognised(words: list[str], expected: bool) -> None:
    assert is_cluster_command(words) is expected


def test_starting_a_stage_outside_the_cluster_tier_fails_the_test() -> None:
    with pytest.raises(pytest.fail.Exception, match="mark them `pytest.mark.cluster`"):
        subprocess.Popen([sys.executable, "-m", "layerbus.stages", "--help"])
