"""`layerbus broker`: a broker for stages started by hand (`layerbus stage`, `run_cluster.sh`), serving
queued jobs of its model from the store until Ctrl-C or SIGTERM, which stop it and its stages cleanly."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from layerbus.cli.errors import EXIT_CHAIN_LEFT, EXIT_FAILED, EXIT_OK, UsageError
from layerbus.cli.options import (
    AUTO_CHAINS,
    add_cluster_options,
    add_db,
    add_metrics,
    add_model,
    add_trace,
    add_weights,
    batching_from_args,
    chains_count,
    command_parser,
    leases_from_args,
    link_probe_from_args,
    model_for_stages,
    open_store,
    pipeline_from_args,
    positive_int,
    report_trace,
    resolve_model,
    results_dir,
    start_metrics,
    wire_from_args,
)
from layerbus.launch.signals import Interrupted, stop_on_signals

if TYPE_CHECKING:
    from layerbus.broker.broker import BrokerConfig
    from layerbus.broker.broker import Broker
    from layerbus.broker.metrics_server import MetricsServer
    from layerbus.wire.curve import ClusterKeys
    from layerbus.storage import JobStatus, JobStore

log = logging.getLogger("layerbus.broker")

# Who speaks on stderr: "layerbus broker", or with the chain it is behind a front door (--chains K).
_speaker = "layerbus broker"


def _say(text: str) -> None:
    print(f"{_speaker}: {text}", file=sys.stderr, flush=True)



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "broker", main, help="run a broker for stages started elsewhere",
                        description="Wait for N stages (`layerbus stage --broker ADDRESS`), split the "
                                    "model over them, then run the store's queued jobs for this model, "
                                    "oldest first, polling for new ones, until Ctrl-C or SIGTERM.") as parser:
        add_model(parser, "Hugging Face model directory every stage can read at this path (default: the default model)")
        parser.add_argument("--stages", metavar="N", type=positive_int, required=True, help="stages to wait for")
        parser.add_argument("--bind-control", metavar="ENDPOINT", default=None,
                            help="where stages register (default: tcp://0.0.0.0:5555 with --keys, tcp://127.0.0.1:5555 "
                                 "without)")
        parser.add_argument("--bind-results", metavar="ENDPOINT", default=None,
                            help="where the last stage returns tokens (default: tcp://0.0.0.0:5556 with --keys, "
                                 "tcp://127.0.0.1:5556 without)")
        parser.add_argument("--keys", metavar="DIR", type=Path, default=None,
                            help="the broker's CurveZMQ keypair (`layerbus keys new DIR --name broker`: a folder "
                                 "holding one NAME.key_secret, or the file): every link authenticated and encrypted; "
                                 "stages need its NAME.key (--broker-key)")
        parser.add_argument("--allow", metavar="DIR", type=Path, action="append", default=[],
                            help="a folder of the stages' public keys (their NAME.key files) that may join, with "
                                 "--keys; repeatable (default: only stages holding the broker's own keypair)")
        parser.add_argument("--insecure", action="store_true",
                            help="allow binds other machines can reach without --keys (unauthenticated, unencrypted)")
        parser.add_argument("--advertise", metavar="HOST", default=None,
                            help="host name or address stages on other machines use to reach this broker")
        parser.add_argument("--network", metavar="FILE", type=Path, default=None,
                            help="the links between the stages' hosts (TOML/JSON: [network] defaults, [[links]] "
                                 "between two host names, optional [hosts] stage = host; as in a cluster file, see "
                                 "examples/network.toml): the plan then keeps stages that share a fast link together "
                                 "(default: each stage's own measured link)")
        add_db(parser)
        parser.add_argument("--job", metavar="JOB", default=None,
                            help="run this one job, then exit (0 iff it completed); default: run jobs as they come")
        parser.add_argument("--exit-when-idle", action="store_true",
                            help="once the stages are placed, serve the queued and running jobs of this model, then "
                                 "exit when none is left (0 iff every job it ran completed) instead of polling for "
                                 "more: for a batch scheduler (`sbatch --wait`, deploy/slurm/layerbus.sbatch)")
        add_cluster_options(parser)
        add_weights(parser)
        add_trace(parser)
        add_metrics(parser)
        parser.add_argument("--poll", metavar="SECONDS", type=float, default=2.0,
                            help="how often to look for new jobs when idle (default: 2)")
        parser.add_argument("--register-timeout", metavar="SECONDS", type=float, default=600.0,
                            help="how long to wait for the stages to register (default: 600)")
        parser.add_argument("--stage-exits", metavar="DIR", type=Path, default=None,
                            help="a folder where the stages' launcher writes NAME.exit (\"NAME CODE [PID]\") for each "
                                 "stage that ended and is not restarted, as deploy/slurm/layerbus.sbatch does: the "
                                 "broker stops waiting for those, and exits at once, naming them, once every stage "
                                 "has ended")
        parser.add_argument("--chains", metavar="K", type=chains_count, default=1,
                            help="form K chains of the N stages (the first N // K stages to register, and so on; one "
                                 "more for the first N %% K chains), all registering at --bind-control: each chain is "
                                 "a broker process of its own, and the chains serve the jobs side by side; auto: "
                                 "profile the stages and let the planner group them (default: 1, one pipeline over "
                                 "every stage)")
        parser.add_argument("--chain-ports", metavar="PORT", type=positive_int, default=None,
                            help="with --chains K: chain i's broker binds ports PORT + 2i (its stages' control) and "
                                 "PORT + 2i + 1 (its results) on the hosts of --bind-control / --bind-results; "
                                 "stages on other machines must reach them too (default: the --bind-control port + 2)")
        # Set by the front door of --chains K on each chain's broker: brokers working the jobs beside it.
        parser.add_argument("--peer-brokers", type=positive_int, default=1, help=argparse.SUPPRESS)
        # ... and a file this broker creates once it listens, so the front door sends it its stages.
        parser.add_argument("--ready-file", type=Path, default=None, help=argparse.SUPPRESS)
        parser.add_argument("--chain-label", default=None, help=argparse.SUPPRESS)  # "chain 2": said in its messages
        # ... and the front door's own bind, where this chain sends its surviving stages if it gives up.
        parser.add_argument("--front-door", default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    import zmq

    from layerbus.broker.broker import Broker, open_control

    if args.exit_when_idle and args.job:
        raise UsageError("--exit-when-idle and --job: --job already exits after its one job: drop one")
    if args.chains != 1:
        return _serve_chains(args)
    if args.chain_label:  # one chain behind a front door (launch/broker_chains.py)
        from layerbus.launch.process_life import die_with_parent

        die_with_parent()  # a killed front door leaves no chain behind
        global _speaker
        _speaker = f"layerbus broker ({args.chain_label})"
    keys, control_bind, results_bind = _security(args)
    pipeline = pipeline_from_args(args)
    # Bound first, and answered from here on (the control thread): stages started before the model is ready
    # hear "preparing the model" and wait, however long that takes, instead of leaving after --broker-timeout.
    try:
        control = open_control(keys, control_bind, pipeline.heartbeat_interval_s)
    except zmq.ZMQError as error:
        raise UsageError(f"cannot bind {control_bind}: {error}; another broker may hold the port: pick another "
                         "with --bind-control") from None
    broker = None
    try:
        control.phase = "preparing the model"
        model_dir = resolve_model(args.model)
        model_for_stages(model_dir, args.stages)
        config = _broker_config(args, model_dir, keys, control_bind, results_bind)
        control.phase = "opening the job store"
        with open_store(args.db) as store:
            if args.job:
                store.job_status(args.job)  # StoreError names a job that does not exist
            try:
                broker = Broker(config, control=control)
            except zmq.ZMQError as error:
                raise UsageError(f"cannot bind {results_bind}: {error}; another broker may hold the port: pick "
                                 "another with --bind-results") from None
            if args.stage_exits is not None:
                from layerbus.broker.stage_exits import ExitFolder

                control.children = ExitFolder(args.stage_exits, args.stages)
            return _serve_broker(store, broker, model_dir, args)
    finally:
        if broker is None and not control.closed:  # never started: the stages that registered wait for the next
            control.close()
            if control.owns_context:
                control.io.context.term()


def _serve_broker(store: JobStore, broker: Broker, model_dir: Path, args: argparse.Namespace) -> int:
    """Serve with the broker until its work is done, a signal or a failure; close it on the way out."""
    if args.ready_file is not None:
        args.ready_file.touch()
    metrics = None
    try:
        metrics = start_metrics(args)  # /healthz says 503 while the stages register and load
        if metrics is not None:
            metrics.attach(broker)
        with stop_on_signals():
            return _serve(store, broker, model_dir, args, metrics)
    except Interrupted as interrupted:
        _say(f"{interrupted}: stopped; stages told to stop, items in flight requeued")
        return interrupted.exit_code  # 130 / 143, as for `layerbus run`
    finally:
        broker.close()  # writes --trace's file with what it has
        report_trace(args.trace)
        if metrics is not None:
            metrics.close()


def _broker_config(args: argparse.Namespace, model_dir: Path, keys, control_bind: str, results_bind: str) -> BrokerConfig:
    from layerbus.broker.broker import BrokerConfig

    network = None
    if args.network is not None:
        from layerbus.planner.cluster_file import ClusterFileError, read_network_file

        try:
            network = read_network_file(args.network)
        except ClusterFileError as error:
            raise UsageError(f"--network: {error}") from None
    return BrokerConfig(str(model_dir), args.stages, control_bind=control_bind, keys=keys,
                        results_bind=results_bind, advertise_host=args.advertise, partition=args.partition,
                        batching=batching_from_args(args), pipeline=pipeline_from_args(args),
                        **wire_from_args(args), weights=args.weights,
                        register_timeout_s=args.register_timeout, trace=args.trace, network=network,
                        link_probe=link_probe_from_args(args))


def _serve_chains(args: argparse.Namespace) -> int:
    """--chains K: the front door and a broker process per chain (launch/broker_chains.py). What can be checked
    here is, before any chain starts: the counts, the model (every stage of the longest chain needs a
    layer), the keys and binds, the job."""
    from layerbus.launch.broker_chains import serve_chains
    from layerbus.jobs.chain_split import chains_error, split_stages

    auto = args.chains == AUTO_CHAINS
    error = None if auto else chains_error(args.stages, args.chains)
    if error is not None:
        raise UsageError(error)
    if auto and args.partition != "planned":
        raise UsageError(f"--chains auto chooses from the stages' profiles, which --partition {args.partition} does "
                         "not use: drop --partition, or pin --chains K")
    if args.metrics is not None or args.trace is not None:
        raise UsageError(f"--metrics and --trace serve one broker; --chains {args.chains} may run several: drop "
                         "them, or use --chains 1")
    keys, control_bind, results_bind = _security(args)
    model_dir = resolve_model(args.model)
    # Every stage of the longest chain needs a layer (under auto the planner leaves out what finds none).
    model_for_stages(model_dir, 1 if auto else max(share.count for share in split_stages(args.stages, args.chains)))
    if args.job:
        with open_store(args.db) as store:
            store.job_status(args.job)  # StoreError names a job that does not exist
    # Under auto a broker on the front door's own address profiles the stages for the planner first.
    profiler = _broker_config(args, model_dir, keys, control_bind, results_bind) if auto else None
    return serve_chains(args, keys, control_bind, results_bind, profiler)


def _security(args: argparse.Namespace) -> tuple["ClusterKeys | None", str, str]:
    """The broker's keys and its two binds. With keys both listen on every interface by default; without,
    on loopback only, and a bind other machines can reach is refused unless --insecure says so."""
    from layerbus.wire.curve import (
        ClusterKeys,
        CurveKeyError,
        allowed_keys,
        insecure_warning,
        is_loopback,
        read_keypair,
        unsecured_bind_message,
    )

    if args.allow and args.keys is None:
        raise UsageError("--allow needs --keys: the broker's own keypair (`layerbus keys new DIR --name broker`)")
    if args.keys is not None and args.insecure:
        raise UsageError("--insecure and --keys contradict each other: drop one")
    try:
        keys = None if args.keys is None else ClusterKeys(
            read_keypair(args.keys), frozenset(key for folder in args.allow for key in allowed_keys(folder)))
    except CurveKeyError as error:
        raise UsageError(str(error)) from None
    host = "0.0.0.0" if keys is not None else "127.0.0.1"
    control_bind = args.bind_control or f"tcp://{host}:5555"
    results_bind = args.bind_results or f"tcp://{host}:5556"
    exposed = [bind for bind in (control_bind, results_bind) if not is_loopback(bind)]
    if exposed and keys is None:
        if not args.insecure:
            raise UsageError(unsecured_bind_message(exposed, "--keys DIR (and --allow DIR for the stages' keys)"))
        _say(insecure_warning(exposed))
    return keys, control_bind, results_bind


def _serve(store: JobStore, broker: Broker, model_dir: Path, args: argparse.Namespace,
           metrics: MetricsServer | None = None) -> int:
    from layerbus.jobs.runner import run_job
    from layerbus.storage.run_info import write_run_info
    from layerbus.storage.states import RUNNABLE_JOB_STATES

    leases = replace(leases_from_args(args), peers=args.peer_brokers)
    keys = broker.config.keys
    key_options = f" --keys DIR --broker-key {str(keys.keypair.path).removesuffix('_secret')}" if keys else ""
    if args.chain_label:  # the stages register at the front door, which sends them here
        _say(f"waiting for {args.stages} stage(s) at {broker.address}, sent here by the front door")
    else:
        _say(f"waiting for {args.stages} stage(s) at {broker.address}: start each with "
             f"`layerbus stage --broker {broker.address}{key_options}`")
    if "0.0.0.0" in broker.address:
        _say("stages on other machines use this machine's address instead of 0.0.0.0, and "
             "need this broker started with --advertise HOST so their last stage can reach the results port")
    broker.start()
    _say(f"ready: {broker.placement.text()}")
    if args.job:
        _record_start(store, broker, args.job)
        write_run_info(args.job, broker.run_info())
        if metrics is not None:
            metrics.watch_job(store, args.job)
        status = run_job(store, args.job, broker, results_dir(), leases=leases)
        _report(status)
        if status.status in RUNNABLE_JOB_STATES:  # its stages broke and it left the job to other brokers
            return _leave(broker, args, args.job)
        return EXIT_OK if status.status == "completed" else EXIT_FAILED
    warned: set[str] = set()
    ran: list[JobStatus] = []
    while True:
        # Looked up only now that the stages are placed, and again after every job: a job queued while the
        # stages were registering, or while another job ran, is served before an idle broker exits.
        job_id = next_job_for(store, model_dir, warned)
        if job_id is None and args.exit_when_idle:
            code = exit_code_when_idle([status.status for status in ran])
            _say(f"no queued or running job for {model_dir}: exiting (--exit-when-idle) after "
                 f"{len(ran)} job(s), {sum(s.status == 'completed' for s in ran)} completed")
            return code
        if job_id is None:
            _idle(broker, args.poll)
            continue
        _say(f"running {job_id}")
        _record_start(store, broker, job_id)
        write_run_info(job_id, broker.run_info())
        if metrics is not None:
            metrics.watch_job(store, job_id)
        ran.append(run_job(store, job_id, broker, results_dir(), leases=leases))
        _report(ran[-1])
        if ran[-1].status in RUNNABLE_JOB_STATES:  # its stages broke and it left the job to other brokers
            return _leave(broker, args, job_id)


def _record_start(store: JobStore, broker: Broker, job_id: str) -> None:
    """What went wrong while the stages were placed (a stage lost, one that ended), in the first job's events:
    the job is not known until then."""
    for kind, message in broker.start_events:
        store.add_job_event(job_id, kind, message)
    broker.start_events.clear()


def _leave(broker: Broker, args: argparse.Namespace, job_id: str) -> int:
    """This broker's stages broke and it left `job_id` to the other brokers working it: exit. One chain
    behind a front door first sends its surviving stages back there (their spans dropped), which sends
    them on to the chains still working, instead of telling them to stop."""
    _say(f"this broker's stages broke; {job_id} is left to the other brokers working it "
         f"(`layerbus status {job_id}`): exiting")
    if args.front_door is None:
        return EXIT_FAILED
    sent = broker.control.release_all(args.front_door)
    if sent:
        _say(f"sent its {len(sent)} surviving stage(s) ({', '.join(stage.name for stage in sent)}) back to the "
             f"front door at {args.front_door}, for the chains still working")
    return EXIT_CHAIN_LEFT


def exit_code_when_idle(final_states: list[str]) -> int:
    """`--exit-when-idle`'s exit code from the final states of the jobs this broker ran: 0 iff each completed
    (none ran: nothing failed), so a batch scheduler's job fails when one of its jobs did."""
    return EXIT_OK if all(state == "completed" for state in final_states) else EXIT_FAILED


def next_job_for(store: JobStore, model_dir: Path, warned: set[str]) -> str | None:
    """The oldest queued or in-progress job for this broker's model."""
    from layerbus.storage.states import RUNNABLE_JOB_STATES

    job_id = store.next_runnable_job()
    if job_id is None:
        return None
    if _same_model(store.job_settings(job_id).model, model_dir):
        return job_id
    runnable = [s for s in reversed(store.list_jobs(limit=500)) if s.status in RUNNABLE_JOB_STATES]
    for status in runnable:
        if _same_model(status.model, model_dir):
            return status.job_id
        if status.job_id not in warned:
            warned.add(status.job_id)
            _say(f"skipping {status.job_id}: it is for model {status.model}, this broker serves "
                 f"{model_dir}")
    return None


def _same_model(job_model: str, model_dir: Path) -> bool:
    return Path(job_model).expanduser().resolve() == model_dir.resolve()


def _idle(broker: Broker, seconds: float) -> None:
    """Keep the stages' heartbeats going while there is no job; re-plan if one is lost."""
    broker.keep_alive(seconds)


def _report(status: JobStatus) -> None:
    done = status.completed + status.failed + status.cancelled
    path = f"; results {status.results_path}" if status.results_path else ""
    error = f": {status.error}" if status.error else ""
    _say(f"{status.job_id} {status.status}{error} ({done}/{status.total} items, "
         f"{status.failed} failed){path}")

