"""`layerbus netprobe`: measure the network before planning a cluster on it.

`layerbus netprobe serve [--bind ADDRESS]` answers probes (run it on the other machine);
`layerbus netprobe tcp://HOST:PORT` times round trips to it and its bandwidth for messages the size
of one decode step of the given model, micro-batch and wire codecs, and says what that costs per
token and how many micro-batches in flight hide it (wire/link_cost.py has the arithmetic,
wire/link_probe.py the measuring). It probes a `netprobe serve` only: a running broker or stage
answers no probe from outside its cluster (the broker times its own links when it profiles).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from layerbus.cli.errors import EXIT_OK, RunFailed, UsageError
from layerbus.cli.options import command_parser, positive_float, positive_int
from layerbus.wire.codec_sizes import CODEC_ALIASES, CODEC_NAMES, codec_name, codec_part_bytes
from layerbus.wire.link_cost import LinkCost, link_cost, mbit_per_s, micro_batches_in_flight, round_trips

DEFAULT_BIND = "tcp://127.0.0.1:7690"
MAX_STEP_BYTES = 256 << 20  # one probe message; a real step this large would not fit a stage's message limit either
QUEUED_BYTES = 64 << 20  # messages the prober's socket may queue at once: a burst never holds more memory
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "netprobe", main,
                        help="measure round trips and bandwidth to another machine, and what they cost per token",
                        description="Measure the link to `layerbus netprobe serve` on another machine: "
                                    "round trips (min, median, p99), bandwidth for messages the size of "
                                    "one decode step of the model at this micro-batch and wire codec, what "
                                    "the link adds per token, and the micro-batches in flight a chain "
                                    "needs to hide it. `layerbus netprobe serve` answers probes; answers "
                                    "come back on a connection it opens to this machine, as a chain's last "
                                    "stage connects to the broker.") as parser:
        parser.add_argument("target", metavar="serve|tcp://HOST:PORT",
                            help="'serve' to answer probes here, or the address of a `layerbus netprobe serve` to "
                                 "probe")
        parser.add_argument("--bind", metavar="ADDRESS", default=None,
                            help=f"serve: where to listen (default: {DEFAULT_BIND}, this machine only; "
                                 "tcp://0.0.0.0:7690 for others, tcp://127.0.0.1:* for any free port)")
        parser.add_argument("--model", metavar="DIR_OR_NAME", default=None,
                            help="model whose hidden size sets the step size (default: SmolLM2-135M-Instruct)")
        parser.add_argument("--micro-batch", metavar="N", type=positive_int, default=32,
                            help="sequences per micro-batch: rows of one decode step (default: 32, the broker's)")
        parser.add_argument("--codec", metavar="CODEC", nargs="+", type=_codec, default=["float32"],
                            help=f"wire codecs to measure: {', '.join(CODEC_NAMES)} (or {', '.join(CODEC_ALIASES)}); "
                                 "several give one row each (default: float32)")
        parser.add_argument("--dtype", choices=tuple(FLOAT_BYTES), default="float32",
                            help="the stages' dtype: the float32 codec sends their values as they are (default: "
                                 "float32)")
        parser.add_argument("--echoes", metavar="N", type=positive_int, default=200,
                            help="round trips to time (default: 200)")
        parser.add_argument("--seconds", metavar="S", type=positive_float, default=0.5,
                            help="each bandwidth figure comes from a burst at least this long (default: 0.5)")
        parser.add_argument("--step-ms", metavar="MS", type=positive_float, default=None,
                            help="a stage's compute per decode step (`layerbus plan` shows it per stage), for the "
                                 "micro-batches in flight (default: not shown)")
        parser.add_argument("--stages", metavar="N", type=positive_int, default=2,
                            help="stages of the chain the micro-batches in flight are for (default: 2)")
        parser.add_argument("--wait", metavar="S", type=positive_float, default=5.0,
                            help="seconds to wait for the first answer, which opens the connections (default: 5)")
        parser.add_argument("--reply-address", metavar="HOST", default=None,
                            help="this machine's address as the peer reaches it (default: the one on the route to it)")
        parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def _codec(text: str) -> str:
    try:
        return codec_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(args: argparse.Namespace) -> int:
    if args.target == "serve":
        return serve(args.bind or DEFAULT_BIND)
    if not args.target.startswith("tcp://") or ":" not in args.target[len("tcp://"):]:
        raise UsageError(f"{args.target!r} is neither 'serve' nor an address like tcp://HOST:PORT: start `layerbus "
                         "netprobe serve --bind tcp://0.0.0.0:7690` on the other machine and give its address")
    if args.bind is not None:
        raise UsageError("--bind is for `layerbus netprobe serve`; the prober answers on --reply-address")
    hidden, model_name = model_hidden_size(args.model)
    report = probe(args.target, hidden, model_name, args)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return EXIT_OK


# -- the model ---------------------------------------------------------------------------------------

def model_hidden_size(model: str | None) -> tuple[int, str]:
    """(hidden size, the model's name) from config.json, read as JSON: no torch, no transformers."""
    from layerbus.cli.options import resolve_model
    from layerbus.models.model_names import find_named_model

    path = resolve_model(None) if model is None else find_named_model(model, lambda text: print(text, file=sys.stderr))
    if path is None:
        raise UsageError(f"--model {model}: no model directory with a config.json there, and no prepared model of that "
                         "name: give a Hugging Face model directory")
    config_file = Path(path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {config_file}: {error}") from None
    hidden = config.get("hidden_size", (config.get("text_config") or {}).get("hidden_size"))
    if type(hidden) is not int or hidden < 1:
        raise UsageError(f"{config_file} gives no positive hidden_size (got {hidden!r}): is it a decoder model's "
                         "config?")
    return hidden, Path(path).name


# -- probing -----------------------------------------------------------------------------------------

def probe(target: str, hidden: int, model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Measure the link to `target` for every codec asked; the report as JSON-ready values."""
    from layerbus.wire import link_probe

    parts = {codec: link_probe.step_parts(codec_part_bytes(codec, args.micro_batch, hidden, FLOAT_BYTES[args.dtype]))
             for codec in args.codec}
    largest = max(sum(p.values()) for p in parts.values())
    if largest > MAX_STEP_BYTES:
        raise UsageError(f"one step of --micro-batch {args.micro_batch} x hidden {hidden} is {largest:,} bytes, over "
                         f"{MAX_STEP_BYTES:,}: give a smaller --micro-batch")
    with _prober_sockets(target, args.reply_address, largest) as (out, inp, reply):
        try:
            link_probe.measure_round_trips(out, inp, reply, 1, timeout_s=args.wait)  # connects both ways; not counted
        except link_probe.ProbeError:
            raise RunFailed(f"no answer from {target} within {args.wait:g} s: is `layerbus netprobe serve --bind "
                            f"tcp://0.0.0.0:PORT` running there, and can it reach this machine at {reply} (answers "
                            "come back on a connection it opens; --reply-address sets the address)?") from None
        try:
            rtt = round_trips(link_probe.measure_round_trips(out, inp, reply, args.echoes, first_seq=1))
            links, burst = [], 0
            for codec, codec_parts in parts.items():
                sample = link_probe.measure_bandwidth(out, inp, reply, codec_parts, args.micro_batch, rtt.median_s,
                                                      target_s=args.seconds, first_burst=burst)
                burst += sample.bursts
                cost = link_cost(sample.burst.step_bytes, args.micro_batch, sample.bytes_per_s, rtt.one_way_s)
                links.append(_link_json(codec, codec_parts, sample, cost, args))
        except link_probe.ProbeError as error:  # it answered at first: it stopped, or the link broke
            raise RunFailed(f"probing {target} stopped: {error}") from None
        link_probe.say_goodbye(out, reply)
    return {"target": target, "reply": reply, "model": model_name, "hidden_size": hidden,
            "micro_batch": args.micro_batch, "dtype": args.dtype, "stages": args.stages, "step_ms": args.step_ms,
            "rtt": {"count": rtt.count, "min_ms": rtt.min_s * 1e3, "median_ms": rtt.median_s * 1e3,
                    "p99_ms": rtt.p99_s * 1e3},
            "links": links}


@contextmanager
def _prober_sockets(target: str, reply_address: str | None, largest: int) -> Iterator[tuple[Any, Any, str]]:
    """(PUSH connected to `target`, bound PULL for the answers, that PULL's address), closed on exit.
    The PUSH queues at most QUEUED_BYTES of `largest`-byte messages."""
    import zmq

    host, family = _local_address(target, reply_address)
    context = zmq.Context()
    out, inp = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    try:
        for sock in (out, inp):
            sock.ipv6 = family == socket.AF_INET6
            sock.linger = 0
        out.sndhwm = max(4, min(1000, QUEUED_BYTES // max(largest, 1)))
        try:
            out.connect(target)
            inp.bind(f"tcp://{host}:*")
        except zmq.ZMQError as error:
            raise UsageError(f"cannot probe {target} answering on {host}: {error} (--reply-address sets this machine's "
                             "address)") from None
        yield out, inp, inp.last_endpoint.decode()
    finally:
        out.close()
        inp.close()
        context.term()


def _link_json(codec: str, parts: dict[str, int], sample, cost: LinkCost, args: argparse.Namespace) -> dict:
    in_flight = None
    if args.step_ms is not None:
        in_flight = micro_batches_in_flight(args.stages, cost, args.step_ms / 1e3)
    tensor_bytes = sum(parts.values())
    return {"codec": codec, "tensor_bytes": tensor_bytes, "header_bytes": sample.burst.step_bytes - tensor_bytes,
            "messages": sample.burst.messages, "bytes_sent": sample.burst.bytes_sent, "seconds": sample.burst.seconds,
            "bandwidth_bytes_per_s": sample.bytes_per_s, "bandwidth_mbit_s": mbit_per_s(sample.bytes_per_s),
            **cost.to_json(), "micro_batches_in_flight": in_flight,
            "hideable": None if args.step_ms is None else in_flight is not None}


def _local_address(target: str, given: str | None) -> tuple[str, int]:
    """(this machine's address as `target`'s host reaches it, its address family): the source address
    the kernel picks for a route there (a UDP connect sends nothing), unless --reply-address gives one."""
    host, _, port = target[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    try:
        family, kind, _, _, address = socket.getaddrinfo(given or host, int(port), type=socket.SOCK_DGRAM)[0]
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot resolve {given or target}: {error}") from None
    if given:
        local = address[0]
    else:
        with socket.socket(family, kind) as udp:
            try:
                udp.connect(address)
            except OSError as error:
                raise UsageError(f"no route to {target}: {error}") from None
            local = udp.getsockname()[0]
    return (f"[{local}]" if family == socket.AF_INET6 else local), family


# -- serving -----------------------------------------------------------------------------------------

def serve(bind: str) -> int:
    """Answer probes on `bind` until SIGINT or SIGTERM; the bound address is stdout's first line."""
    import zmq

    from layerbus.launch.signals import Interrupted, stop_on_signals
    from layerbus.wire.link_probe import EchoPeer, serve as serve_probes

    context = zmq.Context()
    inp = context.socket(zmq.PULL)
    inp.rcvhwm = 64  # queued step messages: bounded memory whatever the prober sends
    inp.linger = 0
    try:
        inp.bind(bind)
    except zmq.ZMQError as error:
        inp.close()
        context.term()
        raise UsageError(f"cannot listen on {bind}: {error} (another port: --bind tcp://HOST:PORT)") from None
    peer = EchoPeer(context)
    address = inp.last_endpoint.decode()
    print(address, flush=True)
    where = ("this machine only: --bind tcp://0.0.0.0:PORT answers others" if "://127." in address
             else "from another machine: `layerbus netprobe tcp://THIS_HOST:PORT`")
    print(f"layerbus netprobe: answering probes on {address} ({where}; Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        with stop_on_signals():
            serve_probes(inp, peer)
    except Interrupted:
        pass
    finally:
        peer.close()
        inp.close()
        context.term()
    return EXIT_OK


# -- the report --------------------------------------------------------------------------------------

def format_report(report: dict[str, Any]) -> str:
    """The report as a table with a few lines of explanation."""
    from layerbus.planner.cluster_file import link_entry

    rtt = report["rtt"]
    lines = [f"layerbus netprobe {report['target']} (answers to {report['reply']})",
             f"round trip, {rtt['count']} echoes: min {rtt['min_ms']:.3f} ms, median {rtt['median_ms']:.3f} ms, "
             f"p99 {rtt['p99_ms']:.3f} ms",
             f"one decode step: {report['model']} (hidden {report['hidden_size']}), micro-batch "
             f"{report['micro_batch']}, {report['dtype']} stages"
             + (f", {report['step_ms']:g} ms compute per step, {report['stages']} stages" if report["step_ms"] else ""),
             ""]
    header = ("codec", "step bytes", "Mbit/s", "transfer ms", "link ms/step", "ms/token", "link cap tok/s",
              "in flight")
    rows = [header]
    for link in report["links"]:
        needed = link["micro_batches_in_flight"]
        in_flight = "-" if report["step_ms"] is None else "not hideable" if needed is None else str(needed)
        rows.append((link["codec"], f"{link['step_bytes']:,}", f"{link['bandwidth_mbit_s']:,.1f}",
                     f"{link['transfer_ms']:.3f}", f"{link['link_step_ms']:.3f}", f"{link['per_token_ms']:.4f}",
                     f"{link['tokens_per_s_cap']:,.0f}", in_flight))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines += ["",
              "link ms/step = median round trip / 2 + transfer: what each sequence waits on this link per token.",
              "ms/token = link ms/step / micro-batch: its cost per generated token when nothing overlaps it "
              "(batching amortizes it).",
              "link cap = the tokens/s at which this link is busy all the time.",
              f"in flight = micro-batches a chain of {report['stages']} stages over such links needs for no stage to "
              "wait: ceil((stages x step + (stages-1) x link + round trip) / step); "
              + ("'not hideable': the transfer alone outlasts the compute, so the link sets the pace."
                 if report["step_ms"] else "give --step-ms (`layerbus plan` shows ms per step) to see it."),
              f"For `--wire auto`, give --link-mbps {report['links'][0]['bandwidth_mbit_s']:.0f} "
              "(or per link, as measured between each pair of machines).",
              "For `layerbus plan --cluster FILE`, this link between two hosts (name them as the stages do):",
              link_entry(report["links"][0]["bandwidth_bytes_per_s"], report["rtt"]["median_ms"] / 2e3)]
    return "\n".join(lines)
