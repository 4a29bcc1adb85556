"""Reading a cluster description (JSON, or TOML through the standard library) into stage profiles,
for planning a cluster one does not have at hand. The format is documented in docs/placement.md
("`layerbus plan` and cluster files").

Each stage gives its memory and either a relative `speed` (times then follow from the model's
FLOPs at `speed x reference_gflops`) or measured per-layer times in milliseconds. Stages may name
the `host` they run on; `[[links]]` between two hosts and the `[network]` defaults then give the
link between every pair of stages (planner.network)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from layerbus.planner.network import BROKER, HostLinks, Link, LinkMatrix
from layerbus.planner.partition import ModelCost
from layerbus.planner.placement import Shapes, StageProfile
from layerbus.wire.weight_formats import WEIGHT_FORMATS

TOP_FIELDS = {"stages", "reference_gflops", "links", "network"}
STAGE_FIELDS = {"name", "device", "speed", "layer_decode_ms", "layer_prefill_ms", "embed_ms", "head_ms",
                "step_overhead_ms", "memory", "link_bandwidth", "link_latency_ms", "host", "weights"}
LINK_FIELDS = {"between", "bandwidth", "latency_ms"}
NETWORK_FIELDS = {"bandwidth", "latency_ms", "host_bandwidth", "host_latency_ms", "broker_host"}
DEFAULT_REFERENCE_GFLOPS = 50.0  # one modern CPU core in float32, about what speed = 1.0 means by default
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ClusterFileError(ValueError):
    """A cluster file that cannot be used; the message names the file, the stage and the field."""


@dataclass(frozen=True)
class Cluster:
    """A described cluster: its stages, and the links between them where hosts are given."""

    profiles: list[StageProfile]
    network: LinkMatrix | None  # None: no hosts given, each stage sends at its own link_bandwidth


def read_cluster_file(path: str | Path, cost: ModelCost, shapes: Shapes) -> list[StageProfile]:
    return read_cluster(path, cost, shapes).profiles


def read_cluster(path: str | Path, cost: ModelCost, shapes: Shapes) -> Cluster:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ClusterFileError(f"cannot read cluster file {path}: {error.strerror or error}") from None
    return cluster_from_description(_parse(path, text), cost, shapes, str(path))


def cluster_from_description(data: dict, cost: ModelCost, shapes: Shapes, source: str = "cluster") -> Cluster:
    profiles = profiles_from_description(data, cost, shapes, source)
    return Cluster(profiles, network_from_description(data, profiles, source))


def _parse(path: Path, text: str, top: str = "an object with a 'stages' list") -> dict:
    if path.suffix.lower() == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ClusterFileError(f"{path} is not valid TOML: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ClusterFileError(f"{path} is not valid JSON ({error}); name the file *.toml for TOML") from None
    if not isinstance(data, dict):
        raise ClusterFileError(f"{path}: the top level must be {top}")
    return data


def profiles_from_description(data: dict, cost: ModelCost, shapes: Shapes, source: str = "cluster") -> list[StageProfile]:
    unknown = set(data) - TOP_FIELDS
    if unknown:
        raise ClusterFileError(f"{source}: unknown top-level field(s) {sorted(unknown)}; known: {sorted(TOP_FIELDS)}")
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ClusterFileError(f"{source}: needs a non-empty 'stages' list ([[stages]] tables in TOML)")
    reference = _positive(data.get("reference_gflops", DEFAULT_REFERENCE_GFLOPS), f"{source}: reference_gflops")
    profiles, names = [], set()
    for index, stage in enumerate(stages):
        where = f"{source}: stage {index + 1}"
        if not isinstance(stage, dict):
            raise ClusterFileError(f"{where} must be an object/table, got {stage!r:.40}")
        where = f"{source}: stage {stage.get('name', index + 1)!r}"
        unknown = set(stage) - STAGE_FIELDS
        if unknown:
            raise ClusterFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(STAGE_FIELDS)}")
        name = stage.get("name", f"stage-{index}")
        if not isinstance(name, str) or not name or name in names:
            raise ClusterFileError(f"{where}: 'name' must be a unique non-empty string")
        names.add(name)
        profiles.append(_profile(name, stage, where, cost, shapes, reference))
    return profiles


def network_from_description(data: dict, profiles: list[StageProfile], source: str = "cluster") -> LinkMatrix | None:
    """The link matrix the stages' hosts, `[[links]]` and `[network]` describe; None without hosts."""
    hosted = [p.name for p in profiles if p.host]
    if not hosted:
        for field in ("links", "network"):
            if field in data:
                raise ClusterFileError(f"{source}: '{field}' describes links between hosts, but no stage names its "
                                       "host: give each stage host = \"...\"")
        return None
    if len(hosted) != len(profiles):
        missing = [p.name for p in profiles if not p.host]
        raise ClusterFileError(f"{source}: stage(s) {missing} have no 'host' while others do: give every stage "
                               "its host, or none")
    if BROKER in {p.name for p in profiles}:
        raise ClusterFileError(f"{source}: stage {BROKER!r}: with hosts, '{BROKER}' names the broker's end of the "
                               "links: rename the stage")
    hosts = {p.name: p.host for p in profiles}
    return host_links(data, hosts, source, set(hosts.values())).matrix([p.name for p in profiles])


def read_network_file(path: str | Path) -> HostLinks:
    """A live broker's view of the links (`layerbus broker --network FILE`): a cluster file's `[network]`
    and `[[links]]` between host names as the stages register them (their machine's host name), and
    optionally `[hosts]` (stage name = host) for stages whose host name does not tell them apart."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ClusterFileError(f"cannot read network file {path}: {error.strerror or error}") from None
    data = _parse(path, text, "an object with 'links' and 'network'")
    unknown = set(data) - {"links", "network", "hosts"}
    if unknown:
        raise ClusterFileError(f"{path}: unknown field(s) {sorted(unknown)}; a network file has [network], "
                               "[[links]] and [hosts] (stage = host); stages' speeds and memory are measured live")
    named = data.get("hosts", {})
    if not isinstance(named, dict):
        raise ClusterFileError(f"{path}: 'hosts' must be a table of stage name = host, got {named!r:.40}")
    hosts = {str(stage): _host(host, f"{path}: hosts: {stage}") for stage, host in named.items()}
    if BROKER in hosts:
        raise ClusterFileError(f"{path}: hosts: '{BROKER}' is the broker's end: give [network] broker_host instead")
    return host_links(data, hosts, str(path), None)


def host_links(data: dict, hosts: dict[str, str], source: str, known: set[str] | None) -> HostLinks:
    """`[network]` and `[[links]]` of `data` over `hosts` (stage -> host); `known`: the only hosts a link
    may name (None: any, as for a live broker whose stages have not registered yet)."""
    table = data.get("network", {})
    if not isinstance(table, dict):
        raise ClusterFileError(f"{source}: 'network' must be a table ([network] in TOML), got {table!r:.40}")
    unknown = set(table) - NETWORK_FIELDS
    if unknown:
        raise ClusterFileError(f"{source}: network: unknown field(s) {sorted(unknown)}; "
                               f"known: {sorted(NETWORK_FIELDS)}")
    hosts = dict(hosts)
    if "broker_host" in table:
        hosts[BROKER] = _host(table["broker_host"], f"{source}: network: broker_host")
    default = _link(table, "bandwidth", "latency_ms", f"{source}: network", Link())
    within = _link(table, "host_bandwidth", "host_latency_ms", f"{source}: network", Link())
    links = data.get("links", [])
    if not isinstance(links, list):
        raise ClusterFileError(f"{source}: 'links' must be a list ([[links]] tables in TOML), got {links!r:.40}")
    between: dict[frozenset, Link] = {}
    for index, entry in enumerate(links):
        where = f"{source}: links {index + 1}"
        if not isinstance(entry, dict):
            raise ClusterFileError(f"{where} must be an object/table, got {entry!r:.40}")
        unknown = set(entry) - LINK_FIELDS
        if unknown:
            raise ClusterFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(LINK_FIELDS)}")
        pair = entry.get("between")
        if (not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(h, str) for h in pair)
                or pair[0] == pair[1]):
            raise ClusterFileError(f"{where}: 'between' must name two different hosts, like [\"boxA\", \"boxB\"], "
                                   f"got {pair!r:.60}; within one host see [network] host_bandwidth")
        strange = [h for h in pair if known is not None and h not in known]
        if strange:
            raise ClusterFileError(f"{where}: between: unknown host(s) {strange}; the stages' hosts: {sorted(known)}")
        key = frozenset(pair)
        if key in between:
            raise ClusterFileError(f"{where}: a second link between {pair[0]} and {pair[1]}: give each pair once")
        between[key] = _link(entry, "bandwidth", "latency_ms", where, default)
    return HostLinks(hosts, between, default, within,
                     default_given=bool({"bandwidth", "latency_ms"} & set(table)),
                     within_given=bool({"host_bandwidth", "host_latency_ms"} & set(table)))


def link_entry(bandwidth_bytes_per_s: float, latency_s: float, hosts: tuple[str, str] = ("HOST_A", "HOST_B")) -> str:
    """A measured link as the `[[links]]` entry of a cluster file (what `layerbus netprobe` suggests)."""
    return (f'[[links]]\nbetween = ["{hosts[0]}", "{hosts[1]}"]\nbandwidth = "{bandwidth_bytes_per_s / 1e6:.4g}MB"\n'
            f"latency_ms = {latency_s * 1e3:.3g}")


def _host(value, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterFileError(f"{what} must be a non-empty string (the machine's name), got {value!r:.40}")
    return value


def _link(table: dict, bandwidth: str, latency: str, where: str, default: Link) -> Link:
    return Link(_size(table[bandwidth], f"{where}: {bandwidth}") if bandwidth in table else default.bandwidth,
                _ms(table, latency, where, default.latency_s))


def _profile(name: str, stage: dict, where: str, cost: ModelCost, shapes: Shapes, reference: float) -> StageProfile:
    if "memory" not in stage:
        raise ClusterFileError(f"{where}: 'memory' is required (bytes or a size like \"24GiB\")")
    rows, chunk = shapes.micro_batch_size, shapes.max_step_tokens
    layer_flops = max(cost.layer) if cost.layer else 0.0
    if ("speed" in stage) == ("layer_decode_ms" in stage):
        raise ClusterFileError(f"{where}: give either 'speed' (relative) or 'layer_decode_ms' (measured), not "
                               f"{'both' if 'speed' in stage else 'neither'}")
    if "speed" in stage:
        flops_per_s = _positive(stage["speed"], f"{where}: speed") * reference * 1e9
        decode, prefill = rows * layer_flops / flops_per_s, chunk * layer_flops / flops_per_s
        head, embed = rows * cost.head / flops_per_s, rows * cost.embed / flops_per_s
        for measured in ("layer_prefill_ms", "embed_ms", "head_ms"):
            if measured in stage:
                raise ClusterFileError(f"{where}: '{measured}' goes with 'layer_decode_ms', not with 'speed'")
    else:
        decode = _non_negative(stage["layer_decode_ms"], f"{where}: layer_decode_ms") / 1000
        # Missing times scale from the decode time by FLOPs: a prefill chunk does chunk/rows times
        # the work of a decode step, and the head head/layer times a layer's.
        prefill = _ms(stage, "layer_prefill_ms", where, decode * chunk / rows)
        head = _ms(stage, "head_ms", where, decode * cost.head / layer_flops if layer_flops else 0.0)
        embed = _ms(stage, "embed_ms", where, 0.0)
    host = _host(stage["host"], f"{where}: host") if "host" in stage else ""
    if host and ("link_bandwidth" in stage or "link_latency_ms" in stage):
        raise ClusterFileError(f"{where}: 'link_bandwidth'/'link_latency_ms' describe one outgoing link; with "
                               "hosts, describe links by host pair in [[links]] and [network]")
    weights = stage.get("weights", "auto")
    if weights not in WEIGHT_FORMATS:
        raise ClusterFileError(f"{where}: weights {weights!r:.40} is not one of {', '.join(WEIGHT_FORMATS)}")
    try:
        return StageProfile(
            name=name, layer_decode_s=decode, layer_prefill_s=prefill, embed_s=embed, head_s=head,
            memory_budget=_size(stage["memory"], f"{where}: memory"),
            link_bandwidth=_size(stage["link_bandwidth"], f"{where}: link_bandwidth") if "link_bandwidth" in stage
            else math.inf,
            link_latency_s=_ms(stage, "link_latency_ms", where, 0.0),
            step_overhead_s=_ms(stage, "step_overhead_ms", where, 0.0),
            micro_batch_size=rows, prefill_tokens=chunk, device=str(stage.get("device", "?")), host=host,
            weights=weights)
    except ValueError as error:
        raise ClusterFileError(f"{where}: {error}") from None


def _ms(stage: dict, field: str, where: str, default: float) -> float:
    return _non_negative(stage[field], f"{where}: {field}") / 1000 if field in stage else default


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ClusterFileError(f"{what} must be a number, got {value!r:.40}")
    return float(value)


def _positive(value, what: str) -> float:
    number = _number(value, what)
    if number <= 0:
        raise ClusterFileError(f"{what} must be > 0, got {value}")
    return number


def _non_negative(value, what: str) -> float:
    number = _number(value, what)
    if number < 0:
        raise ClusterFileError(f"{what} must be >= 0, got {value}")
    return number


def _size(value, what: str) -> int:
    """Bytes, or a string with a unit: "24GiB", "1.25GB", "300MB"."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ClusterFileError(f"{what}: {value!r} is not a size; give bytes or a number with a unit "
                                   "(KB, MB, GB, KiB, MiB, GiB)")
        return int(float(match.group(1)) * _UNITS[unit])
    return int(_positive(value, what))
