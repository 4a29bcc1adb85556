"""`python -m layerbus.stages` / `layerbus stage`: run one stage process."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

from layerbus.stages.worker import StageConfig, run_stage
from layerbus.wire.curve import (
    StageKeys,
    insecure_warning,
    is_loopback,
    read_keypair,
    read_public_key,
    unsecured_bind_message,
)
from layerbus.wire.frames import DEFAULT_MAX_MESSAGE_BYTES
from layerbus.wire.weight_formats import WEIGHT_FORMATS

log = logging.getLogger("layerbus.stage")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """'1500000', '300MB', '1.5GiB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or a number with a unit "
                                         f"(KB, MB, GB, KiB, MiB, GiB), e.g. 300MB or 1.5GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return value


def speed_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: --emulate-speed is a fraction of the real speed, 0 < F <= 1")
    return value


def slowdown(text: str) -> tuple[int, float]:
    steps, _, fraction = text.partition(":")
    try:
        parsed = int(steps), float(fraction)
    except ValueError:
        parsed = (-1, float("nan"))
    if parsed[0] < 0 or not 0 < parsed[1] <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: --emulate-slowdown is STEPS:F, e.g. 200:0.25 (after 200 "
                                         "steps, run at a quarter of the speed)")
    return parsed


def wait_seconds(text: str) -> float | None:
    """--wait-for-broker: seconds >= 0, or "inf" / "none" for no limit."""
    if text.strip().lower() in ("inf", "none", "unlimited"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: --wait-for-broker is seconds (>= 0), or inf for no limit")
    return None if value == float("inf") else value


def add_stage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", required=True, help="the broker's control endpoint, e.g. tcp://10.0.0.5:5555")
    parser.add_argument("--name", default="", help="unique stage name (default: host-pid)")
    parser.add_argument("--bind", default="tcp://127.0.0.1:*",
                        help="where this stage receives steps (default: a free port on loopback; "
                             "use tcp://0.0.0.0:PORT with --advertise for other machines)")
    parser.add_argument("--advertise", default=None, help="address other machines use to reach --bind")
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N or mps (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                        help="how this stage holds its layers' weights, over the broker's --weights: auto (its "
                             "--dtype), native (the checkpoint's own blocks), fp32, bf16, fp16, int8 or int4 "
                             "(quantized on load, groups of 32) (default: as the broker says)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--memory-budget", type=byte_size, default=None, metavar="SIZE",
                        help="the stage's whole memory, in bytes or with a unit: 300MB, 1.5GiB; on a CPU its peak "
                             "resident memory: the runtime it measures at start (interpreter, torch: about 0.4 GiB) "
                             "and the loader's one temporary tensor come out of it before weights, KV cache and "
                             "workspace (default: the device's free memory)")
    parser.add_argument("--emulate-memory", type=byte_size, default=None, metavar="SIZE",
                        help="emulation: report SIZE as the memory for weights, KV cache and workspace, as a "
                             "smaller device would (the process itself is not capped)")
    parser.add_argument("--emulate-speed", type=speed_fraction, default=1.0, metavar="F",
                        help="emulation: run at F (0 < F <= 1) of the real speed by sleeping after each step; "
                             "the stage's profile sees the same slowdown (default: 1)")
    parser.add_argument("--emulate-slowdown", type=slowdown, default=None, metavar="STEPS:F",
                        help="emulation: after serving STEPS steps, run at F of the --emulate-speed pace, as a "
                             "throttling card would (its profile, taken before, does not see it)")
    parser.add_argument("--broker-timeout", type=float, default=15.0, metavar="SECONDS",
                        help="once the broker has answered: exit when it is silent this many seconds (default: 15)")
    parser.add_argument("--wait-for-broker", type=wait_seconds, default=None, metavar="SECONDS",
                        help="before the broker has answered: keep registering (with back-off, a log line every "
                             "~10 s) for this many seconds, then exit; a broker started later, or busy preparing "
                             "its model, is waited for (default: no limit)")
    parser.add_argument("--max-message-bytes", type=byte_size, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="SIZE",
                        help="reject data messages larger than this, in bytes or with a unit (default: 1GiB)")
    parser.add_argument("--keys", metavar="DIR", type=Path, default=None,
                        help="this stage's CurveZMQ keypair (`layerbus keys new DIR`: a folder holding one "
                             "NAME.key_secret, or the file): every link authenticated and encrypted; its NAME.key "
                             "goes into the broker's --allow folder")
    parser.add_argument("--broker-key", metavar="FILE", type=Path, default=None,
                        help="the broker's public key file (its NAME.key), with --keys")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a --bind other machines can reach without --keys (unauthenticated, unencrypted)")


def config_from_args(args: argparse.Namespace) -> StageConfig:
    """The stage's config; ValueError (the message says what to change) for keys that cannot be used or a
    bind reachable from other machines without them."""
    return StageConfig(broker=args.broker, name=args.name, bind=args.bind, advertise=args.advertise,
                       device=args.device, dtype=args.dtype, weights=args.weights, threads=args.threads,
                       memory_budget=args.memory_budget, emulate_memory=args.emulate_memory,
                       broker_timeout_s=args.broker_timeout, wait_for_broker_s=args.wait_for_broker,
                       emulate_speed=args.emulate_speed, emulate_slowdown=args.emulate_slowdown,
                       max_message_bytes=args.max_message_bytes, keys=stage_keys(args))


def stage_keys(args: argparse.Namespace) -> StageKeys | None:
    if (args.keys is None) != (args.broker_key is None):
        raise ValueError("--keys and --broker-key go together: this stage's keypair and the broker's public key")
    if args.keys is not None:
        if args.insecure:
            raise ValueError("--insecure and --keys contradict each other: drop one")
        return StageKeys(read_keypair(args.keys), read_public_key(args.broker_key))
    if not is_loopback(args.bind):
        if not args.insecure:
            raise ValueError(unsecured_bind_message([args.bind], "--keys DIR --broker-key FILE"))
        log.warning("%s", insecure_warning([args.bind]))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layerbus stage", description=__doc__)
    add_stage_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as error:  # CurveKeyError included
        parser.error(str(error))
    return run_stage(config)


if __name__ == "__main__":
    sys.exit(main())
