"""`layerbus broker --network FILE`: the links between hosts for a live broker, whose stages' hosts
are what they register with unless the file's [hosts] names them (planner.cluster_file.read_network_file)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from layerbus.planner.cluster_file import ClusterFileError, read_network_file
from layerbus.planner.network import BROKER, Link
from layerbus.cli.main import main as layerbus_main

REPO = Path(__file__).resolve().parents[2]


def test_the_example_reads_as_its_comments_say() -> None:
    network = read_network_file(REPO / "examples" / "network.toml")
    assert network.between[frozenset({"boxA", "boxB"})] == Link(12.5e6, 0.0005)
    assert network.default == Link(125e6, 0.0002) and network.within_host == Link(5e9, 0.00002)
    assert network.hosts == {BROKER: "boxA"}


def test_hosts_come_from_registration_unless_named(tmp_path: Path) -> None:
    path = tmp_path / "net.toml"
    path.write_text('[hosts]\nns-a-0 = "a"\n\n[[links]]\nbetween = ["a", "b"]\nbandwidth = "1MB"\n')
    network = read_network_file(path)
    assert network.hosts == {"ns-a-0": "a"}
    # Any host name may appear in a link: the stages have not registered when the file is read.
    assert network.between == {frozenset({"a", "b"}): Link(1e6, 0.0)} and network.default == Link(math.inf, 0.0)


@pytest.mark.parametrize("text, message", [
    ('[[stages]]\nname = "x"\n', "unknown field(s) ['stages']"),
    ('hosts = 3\n', "'hosts' must be a table of stage name = host"),
    ('[hosts]\nbroker = "a"\n', "give [network] broker_host instead"),
    ('[[links]]\nbetween = ["a", "a"]\n', "'between' must name two different hosts"),
    ('[network]\nspeed = 1\n', "network: unknown field(s) ['speed']"),
    ('[[links]]\nbetween = ["a", "b"]\nbandwidth = "fast"\n', "bandwidth"),
])
def test_bad_network_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "net.toml"
    path.write_text(text)
    with pytest.raises(ClusterFileError, match=None) as raised:
        read_network_file(path)
    assert message in str(raised.value) and str(path) in str(raised.value)


def test_a_missing_network_file_is_a_usage_error(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "none.toml"
    assert layerbus_main(["broker", "--stages", "2", "--network", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--network: cannot read network file" in err and str(missing) in err


def test_live_stages_are_placed_on_their_registered_hosts_unless_the_file_names_them(tmp_path: Path) -> None:
    path = tmp_path / "net.toml"
    path.write_text('[hosts]\ns1 = "b"\n\n[network]\nbroker_host = "a"\n\n'
                    '[[links]]\nbetween = ["a", "b"]\nbandwidth = "1MB"\n')
    matrix = read_network_file(path).placing({"s0": "a", "s1": "a", "s2": "b"}).matrix(["s0", "s1", "s2"])
    slow, fast = Link(1e6, 0.0), Link()
    assert matrix.host("s1") == "b", "the file's [hosts] wins over the registered host name"
    assert matrix.link("s0", "s1") == slow and matrix.link("s1", "s2") == fast and matrix.link("s0", "s2") == slow
    assert matrix.link(BROKER, "s0") == fast and matrix.link("s2", BROKER) == slow
