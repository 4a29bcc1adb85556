"""The console script builds only the chosen subcommand's parser (cli/main.py): its help lines for the
others must be the ones their modules register, and a read-only command imports no other command."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from layerbus.cli.main import SUBCOMMANDS, build_parser, chosen_command


def subcommand_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help for choice in action._choices_actions}


def test_every_help_line_is_the_one_its_module_registers():
    loaded, listed = build_parser(), build_parser(lambda name: False)
    assert subcommand_helps(loaded) == subcommand_helps(listed) == {name: h for name, (_, h) in SUBCOMMANDS.items()}


@pytest.mark.parametrize("argv, command", [
    ([], None), (["--help"], None), (["status"], "status"), (["-v", "status", "job_1"], "status"),
    (["-vv", "eval", "run", "x"], "eval"), (["wire-quality", "--help"], "wire-quality"),
])
def test_the_chosen_command_is_the_first_word_that_is_not_an_option(argv, command):
    assert chosen_command(argv) == command


def test_a_read_only_command_imports_no_other_command():
    probe = ("import json, sys\nfrom layerbus.cli.main import build_parser, chosen_command\n"
             "build_parser(lambda name: name == chosen_command(['status']))\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith('layerbus.cli.'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout)
    others = {f"layerbus.cli.{module}" for name, (module, _) in SUBCOMMANDS.items() if name != "status"}
    assert "layerbus.cli.status" in loaded and not others & set(loaded), loaded


@pytest.mark.parametrize("given, kept", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE"), ("passive", "passive")])
def test_the_cli_makes_openmp_threads_wait_passively_unless_the_user_chose(given, kept):
    """Spinning OpenMP threads took the cores of the processes beside them (models/openmp_waits.py): every
    command sets the passive policy, before it imports torch, for itself and the processes it starts."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    probe = ("import os, sys\nfrom layerbus.cli.main import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert done.stderr.split() == [kept, "False"], done.stderr
