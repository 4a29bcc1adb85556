"""Options several subcommands share, and the few steps they share: opening a subcommand's parser, opening the
store, finding the model."""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerbus.cli.errors import UsageError

if TYPE_CHECKING:
    from layerbus.models.model_info import ModelInfo
    from layerbus.storage import JobStore

TASKS = ("summarize", "translate", "generate")  # as jobs.tasks.TASKS, without importing it for --help


def must_be(wanted: str, accepts: Callable[[Any], bool]):
    """An argparse type from a conversion: a converted value that `accepts` refuses is a usage error,
    "must be `wanted`, got TEXT". The conversion keeps its name, which argparse says when it fails."""
    def checked_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
        @functools.wraps(convert)
        def checked(text: str) -> Any:
            value = convert(text)
            if not accepts(value):
                raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
            return value
        return checked
    return checked_type


@must_be("a positive integer", lambda value: value >= 1)
def positive_int(text: str) -> int:
    return int(text)


@must_be("an integer >= 0", lambda value: value >= 0)
def non_negative_int(text: str) -> int:
    return int(text)


@must_be("a number >= 0", lambda value: value >= 0)  # NaN too is refused
def non_negative_float(text: str) -> float:
    return float(text)


@must_be("a number > 0", lambda value: 0 < value < math.inf)
def positive_float(text: str) -> float:
    return float(text)


@must_be("an integer in [0, 2**63)", lambda value: 0 <= value < 2**63)
def seed(text: str) -> int:
    return int(text)


@must_be("an integer from 1 to 128 (samples per item)", lambda value: 1 <= value <= 128)
def sample_count(text: str) -> int:
    """--n: samples per item, 1 to 128 (as jobs.item_checks.MAX_SAMPLES, without importing it for --help)."""
    return int(text)


@contextmanager
def command_parser(subparsers: argparse._SubParsersAction, name: str, handler: Callable[[argparse.Namespace], int],
                   *, help: str, description: str, epilog: str | None = None) -> Iterator[argparse.ArgumentParser]:
    """A subcommand's parser: opened with its line in the list of commands and its description, its own
    options added in the `with` block, then -v, which ends every command's options, and the handler
    that runs the command."""
    parser = subparsers.add_parser(name, help=help, description=description, epilog=epilog)
    yield parser
    add_verbose(parser)
    parser.set_defaults(handler=handler)


def add_verbose(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's -v adds to the top-level one instead of resetting it.
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="log progress to stderr (-vv: debug)")


def add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", metavar="URL", default=None,
                        help="job store: sqlite:///path.db or postgresql+psycopg://user:pw@host/db "
                             "(default: sqlite under $LAYERBUS_HOME, ~/.local/share/layerbus)")


def add_model(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--model", metavar="DIR", default=None, help=help_text)


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """What `submit` and `run` take to define a job."""
    parser.add_argument("--task", choices=TASKS, help="what to do with each item (required with INPUT)")
    parser.add_argument("--target-language", metavar="L", default=None, help="language to translate into (translate)")
    add_model(parser, "Hugging Face model directory (default: SmolLM2-135M-Instruct, prepared on first use)")
    parser.add_argument("--max-new-tokens", metavar="N", type=positive_int, default=256,
                        help="tokens to generate per item unless the item says max_tokens (default: 256)")
    parser.add_argument("--temperature", metavar="T", type=non_negative_float, default=0.0,
                        help="sampling temperature; 0 = greedy (default: 0)")
    parser.add_argument("--seed", metavar="S", type=seed, default=0,
                        help="job seed: each item samples with a seed derived from it and the item's position")
    parser.add_argument("--n", metavar="N", type=sample_count, default=1,
                        help="samples per item unless the item says n (OpenAI's n), 1 to 128; each sample has a seed "
                             "derived from the item's seed, its id and the sample's index (default: 1)")
    parser.add_argument("--name", default="", help="a name for the job, shown by `layerbus status`")
    constrain = parser.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", metavar="FILE", default=None,
                           help="every output is JSON valid against this JSON schema (constrained decoding; an "
                                "item's own response_format wins)")
    constrain.add_argument("--regex", metavar="R", default=None, help="every output fully matches this regex")
    constrain.add_argument("--choices", metavar="A,B,C", default=None,
                           help="every output is exactly one of these comma-separated strings")
    columns = parser.add_argument_group("columns", "which column (or JSON key) holds each item's id and content; "
                                        "a nested field is dotted (translation.de); without them, inferred when "
                                        "only one column fits, and other columns are then ignored")
    columns.add_argument("--id-column", metavar="NAME", default=None, help="the item's id (default: id or custom_id)")
    columns.add_argument("--text-column", metavar="NAME", default=None,
                         help="the document (summarize, translate) or a raw prompt (generate) (default: text)")
    columns.add_argument("--prompt-column", metavar="NAME", default=None,
                         help="a raw prompt, sent as is (generate) (default: prompt)")
    columns.add_argument("--messages-column", metavar="NAME", default=None,
                         help="chat messages, through the chat template (generate) (default: messages)")
    long = parser.add_argument_group("long documents", "a document whose prompt does not fit the context with "
                                     "its --max-new-tokens (summarize, translate)")
    long.add_argument("--long-documents", choices=("split", "fail", "truncate"), default=None,
                      help="split: into pieces, summarized then reduced, or translated and joined in order; fail: "
                           "the item fails; truncate: its text is cut to fit (default: split; generate: fail)")
    long.add_argument("--max-chunk-tokens", metavar="N", type=positive_int, default=None,
                      help="split a document's text into pieces of at most N tokens even where it fits")
    long.add_argument("--chunk-overlap-tokens", metavar="N", type=non_negative_int, default=0,
                      help="tokens of a piece's last sentences repeated at the start of the next (summarize; "
                           "default: 0)")
    long.add_argument("--map-template", metavar="FILE", default=None,
                      help="what the prompt of each piece of a split document asks: a text file with {document} "
                           "where the piece goes (default: the task's own instruction)")
    long.add_argument("--reduce-template", metavar="FILE", default=None,
                      help="what a reduce asks of the summaries of a document's pieces: a text file with "
                           "{summaries} where they go")
    add_db(parser)
    parser.add_argument("--skip-invalid", action="store_true",
                        help="queue the valid items and record invalid ones as failed (default: refuse the input)")


def add_cluster_options(parser: argparse.ArgumentParser, partition: bool = True) -> None:
    """How the broker batches and splits the model (`run`, `broker`, and without --partition `plan`)."""
    parser.add_argument("--slots", metavar="N", type=non_negative_int, default=0,
                        help="sequences in flight at once (default: 0 = micro-batch size x micro-batches)")
    parser.add_argument("--micro-batch-size", metavar="N", type=non_negative_int, default=0,
                        help="sequences per micro-batch when --slots is 0 (default: 0 = chosen from the stages' "
                             "profiles: the fewest rows whose cost per row is within 15%% of the per-row cost, "
                             "capped by memory and by the job's items; 32 without profiles)")
    parser.add_argument("--micro-batches", metavar="N", type=non_negative_int, default=0,
                        help="micro-batches in flight (default: 0 = planned from the profiles: one per stage or "
                             "one more, 1 for a single stage; stages + 1 without profiles)")
    parser.add_argument("--max-step-tokens", metavar="N", type=non_negative_int, default=0,
                        help="tokens per micro-batch step; long prompts are prefilled in chunks under it (default: "
                             "0 = chosen from the stages' profiles; 256 without profiles)")
    parser.add_argument("--max-context", metavar="N", type=positive_int, default=2048,
                        help="prompt + generated tokens per item, capped by the model's limit (default: 2048)")
    parser.add_argument("--prefix-cache-tokens", metavar="N", type=non_negative_int, default=4096,
                        help="positions of shared prompt prefixes every stage keeps (its own layers' keys and "
                             "values) and copies instead of computing again (default: 4096; 0 = off)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute every prompt whole, shared prefixes included (as --prefix-cache-tokens 0)")
    parser.add_argument("--speculate", metavar="MODE", default="auto",
                        help="draft tokens for the last stage to verify, several tokens per trip down the chain with "
                             "the same outputs: auto (prompt lookup, then the job's own outputs; how far to draft is "
                             "chosen per step from the measured acceptance and trip times, none included), ngram "
                             "(prompt lookup), suffix (the job's finished outputs), off; model:DIR (a draft model) is "
                             "not available yet (default: auto)")
    parser.add_argument("--no-keep-caches", action="store_true",
                        help="stages keep nothing for a re-plan: saves each stage but the last one hidden state per "
                             "slot-position, and after a lost or slowed stage every layer is recomputed, not only "
                             "the moved ones")
    if partition:
        parser.add_argument("--partition", choices=("planned", "balanced", "equal"), default="planned",
                            help="planned: the stages profile themselves and layers follow their speed and memory "
                                 "(see `layerbus plan`); balanced: by FLOPs; equal: by count (default: planned)")
        parser.add_argument("--no-link-probe", action="store_true",
                            help="planned: do not have the stages time the links between them when they register "
                                 "(each stage's link to the broker then prices its sends; a --network file still counts)")
        parser.add_argument("--link-probe-seconds", metavar="S", type=positive_float, default=0.05,
                            help="planned: each link between two stages is timed with bursts of step-sized messages "
                                 "that grow until one lasts S seconds (default: 0.05; longer on slow or shaped links)")
    parser.add_argument("--liveness-window", metavar="S", type=positive_float, default=5.0,
                        help="a stage silent this many seconds is lost: the broker re-plans without it and the "
                             "job goes on (default: 5; stages heartbeat every 0.5 s, even mid-step)")
    parser.add_argument("--lease", metavar="S", type=positive_float, default=60.0,
                        help="a claimed item stays this broker's S seconds without renewal (it renews every few "
                             "seconds): how long a killed broker's items wait before another broker working the "
                             "job takes them over (default: 60)")
    parser.add_argument("--slowdown-threshold", metavar="F", type=non_negative_float, default=3.0,
                        help="with --partition planned, a stage running F times slower than its measured normal "
                             "(relative to the others, 3 windows of 5 s in a row) has layers moved off it; "
                             "0 = never (default: 3)")
    parser.add_argument("--max-step-failures", metavar="N", type=positive_int, default=3,
                        help="an item whose step fails this many times alone fails with the stage's error, and "
                             "the job goes on (default: 3)")
    parser.add_argument("--wire", metavar="CODEC[,CODEC...]", type=wire_codecs, default="float32",
                        help="how hidden states travel between stages: float32, float16, bfloat16, int8, int4 or "
                             "auto; one for every link, or one per link in chain order (default: float32). auto "
                             "picks per link from the table `layerbus wire-quality --save` measured")
    parser.add_argument("--wire-quality", metavar="FILE", default=None,
                        help="quality table for --wire auto (default: the one saved for the model)")
    parser.add_argument("--link-mbps", metavar="M[,M...]", type=link_mbps, default=(),
                        help="bandwidth of each link in Mbit/s, for --wire auto (default: not measured; auto then "
                             "takes the cheapest codec within the quality budget)")


def add_weights(parser: argparse.ArgumentParser, stage_files: bool = False) -> None:
    """--weights for the broker's stages (`run`, `broker`, `plan`); a stage's own --weights wins over it."""
    from layerbus.wire.weight_formats import WEIGHT_FORMATS

    own = "a stage with its own 'weights' in the --cluster file" if stage_files else "a stage started with its own --weights"
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                        help="how the stages hold their layers' weights: auto (the planner chooses per stage: full "
                             "precision in their --dtype where it fits, else int8, else int4), native (the "
                             "checkpoint's own quantized blocks, e.g. a GGUF's Q4_1), fp32, bf16, fp16, or int8 / "
                             "int4 (quantized as they load: symmetric / asymmetric groups of 32); "
                             f"{own} keeps it (default: auto)")


def add_metrics(parser: argparse.ArgumentParser) -> None:
    """--metrics HOST:PORT (`run`, `broker`)."""
    parser.add_argument("--metrics", metavar="HOST:PORT", type=metrics_address, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics and a readiness check at /healthz "
                             "(200 once the chain is placed); a bare PORT listens on 127.0.0.1 only, as do secured "
                             "clusters unless HOST says otherwise; PORT 0 takes any free port (default: no metrics)")


def start_metrics(args: argparse.Namespace):
    """The metrics endpoint --metrics asks for, listening (None without --metrics); an address it cannot
    listen on is a usage error naming it."""
    address = getattr(args, "metrics", None)  # `eval run` shares `run`'s code and has no --metrics
    if address is None:
        return None
    from layerbus.broker.metrics_server import MetricsError, MetricsServer

    try:
        server = MetricsServer(*address)
    except MetricsError as error:
        raise UsageError(str(error)) from None
    print(f"layerbus: metrics at {server.address}/metrics, readiness at {server.address}/healthz", file=sys.stderr,
          flush=True)
    return server


def metrics_address(text: str) -> tuple[str, int]:
    """--metrics: PORT (loopback), HOST:PORT or [IPv6]:PORT, as (host, port). Listening beyond loopback is
    only ever the user's explicit choice: the metrics name hosts, jobs and layer spans."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]") if sep else ""
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise argparse.ArgumentTypeError(f"{text!r}: give PORT (listens on 127.0.0.1), HOST:PORT or [IPv6]:PORT, "
                                         "e.g. 9464 or 0.0.0.0:9464")
    return host or "127.0.0.1", int(port)


WIRE_NAMES = ("float32", "float16", "bfloat16", "int8", "int4", "auto")  # as wire.codecs, without importing torch


def add_trace(parser: argparse.ArgumentParser) -> None:
    """--trace FILE (`run`, `broker`)."""
    parser.add_argument("--trace", metavar="FILE", type=trace_path, default=None,
                        help="write a timeline of every step on every stage and of the broker's scheduling to FILE "
                             "(Trace Event JSON: open it in https://ui.perfetto.dev); written at the end of each run "
                             "and on Ctrl-C (default: no tracing, nothing recorded)")


def trace_path(text: str) -> str:
    path = Path(text).expanduser().absolute()
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name, e.g. {path / 'trace.json'}")
    return str(path)


def report_trace(path: str | None) -> None:
    """Where --trace's file is, once written."""
    if path and Path(path).is_file():
        print(f"layerbus: trace written to {path} (open it in https://ui.perfetto.dev)", file=sys.stderr)


def wire_codecs(text: str) -> tuple[str, ...] | str:
    names = [part.strip() for part in text.split(",")]
    bad = [name for name in names if name not in WIRE_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)} not among {', '.join(WIRE_NAMES)}")
    return names[0] if len(names) == 1 else tuple(names)


def link_mbps(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be numbers of Mbit/s separated by commas, got {text}") from None
    if not all(value > 0 for value in values):
        raise argparse.ArgumentTypeError(f"bandwidths must be > 0 Mbit/s, got {text}")
    return values


def wire_from_args(args: argparse.Namespace) -> dict:
    """BrokerConfig's wire fields from --wire, --wire-quality and --link-mbps."""
    from layerbus.planner.wire_choice import AutoWireInputs

    auto = AutoWireInputs(quality_table=args.wire_quality,
                          link_bandwidth=tuple(mbps * 1e6 / 8 for mbps in args.link_mbps))
    return {"wire": args.wire, "wire_auto": auto}


def link_probe_from_args(args: argparse.Namespace):
    """BrokerConfig's link_probe from --no-link-probe and --link-probe-seconds (defaults where a command has none)."""
    from layerbus.broker.link_probing import LinkProbeConfig

    return LinkProbeConfig(enabled=not getattr(args, "no_link_probe", False),
                           burst_s=getattr(args, "link_probe_seconds", LinkProbeConfig.burst_s))


def batching_from_args(args: argparse.Namespace):
    """The BatchingConfig that --slots, --micro-batch-size, --micro-batches, --max-step-tokens,
    --max-context and the prefix cache's options describe."""
    from layerbus.planner.prefix_budget import PrefixCacheConfig
    from layerbus.planner.batching import BatchingConfig

    from layerbus.planner.speculation import parse_speculate

    prefix_tokens = 0 if getattr(args, "no_prefix_cache", False) else getattr(args, "prefix_cache_tokens", 4096)
    try:
        speculation = parse_speculate(getattr(args, "speculate", "off"))
    except ValueError as error:
        raise UsageError(str(error)) from None
    return BatchingConfig(num_slots=args.slots, micro_batch_size=args.micro_batch_size,
                          num_micro_batches=args.micro_batches, max_step_tokens=args.max_step_tokens,
                          max_context=args.max_context, max_step_failures=args.max_step_failures,
                          prefix_cache=PrefixCacheConfig(budget_tokens=prefix_tokens),
                          keep_caches=not getattr(args, "no_keep_caches", False), speculation=speculation)


def pipeline_from_args(args: argparse.Namespace):
    """The PipelineConfig that --liveness-window and --slowdown-threshold describe."""
    from layerbus.broker.pipeline import PipelineConfig

    if args.liveness_window <= 1.0:
        raise UsageError(f"--liveness-window {args.liveness_window}: stages heartbeat every 0.5 s, so the window must "
                         "be over 1 s (a few heartbeats) or live stages would be declared lost")
    from layerbus.planner.drift import DriftConfig

    threshold = args.slowdown_threshold
    if threshold and threshold <= 1.0:
        raise UsageError(f"--slowdown-threshold {threshold}: a stage is slowed when it runs F > 1 times slower than its "
                         "normal; use e.g. 2, or 0 to never move layers off a slowed stage")
    drift = DriftConfig(threshold=threshold) if threshold else DriftConfig(enabled=False)
    return PipelineConfig(liveness_window_s=args.liveness_window, drift=drift)


def leases_from_args(args: argparse.Namespace):
    """The LeaseConfig that --lease describes."""
    from layerbus.jobs.leases import LeaseConfig

    try:
        return LeaseConfig(lease_s=args.lease)
    except ValueError as error:
        raise UsageError(f"--lease {args.lease}: {error}; use a few seconds or more, e.g. the default 60") from None


def checked_stage_flag(option: str, text: str) -> tuple[str, str]:
    """(`option`, `text`) for a local stage's command line, `text` checked as the stage checks it
    (--emulate-speed, --memory-budget): a usage error now, not a stage that fails to start."""
    from layerbus.stages.__main__ import byte_size, speed_fraction

    check = {"--emulate-speed": speed_fraction, "--memory-budget": byte_size}[option]
    try:
        check(text)
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"{option}: {error}") from None
    return option, text


def open_store(url: str | None) -> JobStore:
    from layerbus.storage import JobStore, default_db_url

    return JobStore.open(url or default_db_url())


def resolve_model(model: str | None) -> Path:
    """The model directory: --model as given, or the default model (prepared on first use)."""
    if model:
        return Path(model).expanduser().absolute()
    from layerbus.models.default_model import default_model_dir

    return default_model_dir(progress=lambda message: print(message, file=sys.stderr))


def model_for_stages(model_dir: Path, num_stages: int) -> ModelInfo:
    """The model's info, after checking it has a layer for every stage."""
    from layerbus.models.model_info import read_model_info

    info = read_model_info(model_dir)
    layers = info.files.num_layers
    if num_stages > layers:
        raise UsageError(f"--stages {num_stages}, but {model_dir} has {layers} layers and every stage needs at "
                         f"least one: use --stages {layers} or fewer")
    return info


def results_dir() -> Path:
    from layerbus.storage import default_results_dir

    return default_results_dir()


AUTO_CHAINS = "auto"  # --chains auto: the planner chooses


def chains_count(text: str) -> int | str:
    """--chains K (`run`, `broker`): a whole number, or 'auto' (AUTO_CHAINS)."""
    if text.strip().lower() == "auto":
        return AUTO_CHAINS
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of chains: give 1 to --stages, or auto") from None
