"""`python -m stages` / `layerbus stage`: run one stage process."""

from __future__ import annotations

import argparse
import logging
import sys

from stages.worker import StageConfig, run_stage


def add_stage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", required=True, help="the broker's control endpoint, e.g. tcp://10.0.0.5:5555")
    parser.add_argument("--name", default="", help="unique stage name (default: host-pid)")
    parser.add_argument("--bind", default="tcp://127.0.0.1:*",
                        help="where this stage receives steps (default: a free port on loopback; "
                             "use tcp://0.0.0.0:PORT with --advertise for other machines)")
    parser.add_argument("--advertise", default=None, help="address other machines use to reach --bind")
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N or mps (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--memory-budget", type=int, default=None, help="bytes for weights + KV cache")
    parser.add_argument("--broker-timeout", type=float, default=15.0,
                        help="exit when the broker is silent this many seconds (default: 15)")


def config_from_args(args: argparse.Namespace) -> StageConfig:
    return StageConfig(broker=args.broker, name=args.name, bind=args.bind, advertise=args.advertise,
                       device=args.device, dtype=args.dtype, threads=args.threads,
                       memory_budget=args.memory_budget, broker_timeout_s=args.broker_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layerbus stage", description=__doc__)
    add_stage_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_stage(config_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
