"""A real stage process (`python -m layerbus.stages`) against a broker played by the test over real
sockets: registration, assignment, serving steps, rejecting malformed input without dying, and
its lifecycle (SIGTERM, a silent broker, a failed load)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from layerbus.broker.control import ControlPlane
from layerbus.wire import protocol
from layerbus.wire.frames import Message, decode, encode
from layerbus.wire.protocol import HEARTBEAT_IDENTITY_SUFFIX

REPO = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=100, max_position_embeddings=128, initializer_range=0.1)
PROMPT = [11, 42, 7, 93, 5, 60]
NUM_SLOTS, MAX_CONTEXT = 4, 64
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
REGISTER_TIMEOUT_S = 90  # the first import of torch + transformers on a busy machine


# -- the broker's side, played by the test --------------------------------------------------------

class FakeBroker:
    """A ROUTER socket where one stage registers; `expect` waits for a kind, skipping heartbeats and the
    registrations a stage sends again until it hears the broker (`registered` answers the first)."""

    def __init__(self, context: zmq.Context):
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.identity: bytes | None = None
        self.seen: list[str] = []

    def receive(self, timeout_s: float) -> Message | None:
        if not self.router.poll(int(timeout_s * 1000)):
            return None
        frames = self.router.recv_multipart(copy=False)
        identity = bytes(frames[0].buffer)
        if not identity.endswith(HEARTBEAT_IDENTITY_SUFFIX):  # the heartbeat thread's socket receives nothing
            self.identity = identity
        message = decode(frames[1:])
        self.seen.append(message.kind)
        return message

    def expect(self, kind: str, timeout_s: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            message = self.receive(remaining)
            if message is None:
                break
            if message.kind == kind:
                return message.header
            if message.kind not in (protocol.HEARTBEAT, protocol.REGISTER):
                raise AssertionError(f"expected {kind!r}, got {message.kind!r}: {message.header}")
        raise AssertionError(f"no {kind!r} within {timeout_s} s (received: {self.seen[-10:]})")

    def send(self, kind: str, **fields) -> None:
        self.router.send_multipart([self.identity, *encode(dict(fields, kind=kind))], copy=False)


class StageProcess:
    """`python -m layerbus.stages` with its own fake broker, results socket and data-plane sender."""

    def __init__(self, context: zmq.Context, log_dir: Path, name: str, *args: str):
        self.context, self.name = context, name
        self.broker = FakeBroker(context)
        self.results = context.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.result_address = f"tcp://127.0.0.1:{self.results.bind_to_random_port('tcp://127.0.0.1')}"
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "layerbus.stages", "--broker", self.broker.address, "--name", name, "--threads", "1",
                 *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.registration: dict | None = None
        self.push: zmq.Socket | None = None
        self.epoch = 0
        self.holds_full_model = False  # set by serve_full_model; any new assignment clears it
        self.assigned_at = 0.0  # monotonic time the last assignment was sent

    def registered(self) -> dict:
        if self.registration is None:
            self.registration = self.broker.expect(protocol.REGISTER, REGISTER_TIMEOUT_S)
            self.broker.send(protocol.HEARTBEAT)  # heard: a real broker's control thread answers at once
            self.push = self.context.socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 0)
            self.push.setsockopt(zmq.SNDTIMEO, 5000)
            self.push.connect(self.registration["data_address"])
        return self.registration

    def assign(self, model_dir: Path | str, layers: list[int], is_first: bool = True, is_last: bool = True,
               epoch: int | None = None, max_context: int = MAX_CONTEXT, **extra) -> None:
        self.registered()
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self.assigned_at = time.monotonic()
        self.holds_full_model = False
        self.broker.send(protocol.ASSIGN, epoch=self.epoch, model_dir=str(model_dir), layers=layers,
                         is_first=is_first, is_last=is_last, next_address=self.result_address,
                         num_slots=NUM_SLOTS, max_context=max_context, **extra)

    def send_frames(self, frames: list) -> None:
        self.push.send_multipart(frames, copy=False)

    def result(self, timeout_s: float = 20.0) -> Message:
        assert self.results.poll(int(timeout_s * 1000)), f"no result within {timeout_s} s\n{self.log_tail()}"
        return decode(self.results.recv_multipart(copy=False))

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"stage still running after {timeout_s} s\n{self.log_tail()}") from None

    def log_tail(self) -> str:
        return "stage log:\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def step_frames(epoch: int, rows: list[list], token_ids: list[int], mb: int = 0, step: int = 0,
                release: list[int] | None = None, **extra) -> list:
    header = dict({"kind": protocol.STEP, "mb": mb, "step": step, "attempt": 0, "epoch": epoch, "rows": rows,
                   "release": release or []}, **extra)
    return encode(header, {"tokens": torch.tensor(token_ids, dtype=torch.int64)})


# -- fixtures -------------------------------------------------------------------------------------

def save_model(path: Path, tied: bool):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=tied)).eval()
    model.save_pretrained(path)  # transformers 5 always writes safetensors
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage_models")
    return {"untied": (root / "untied", save_model(root / "untied", tied=False)),
            "tied": (root / "tied", save_model(root / "tied", tied=True))}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Stage processes started together, so their slow imports overlap; each test takes its own."""
    context = zmq.Context()
    log_dir = tmp_path_factory.mktemp("stage_logs")
    quiet = ("--broker-timeout", "300")  # these tests send no heartbeats; the timeout has its own test
    extra = {"oversized": ("--max-message-bytes", "1KiB")}
    processes = {name: StageProcess(context, log_dir, name, *quiet, *extra.get(name, ()))
                 for name in ("s0", "sigterm", "nested-json", "huge-dim", "bad-next-hop", "oversized")}
    yield processes
    for process in processes.values():
        process.stop()
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def stage(fleet) -> StageProcess:
    return fleet["s0"]


def reference_next(model, sequence: list[int]) -> tuple[int, float]:
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, -1].float()
    token = int(logits.argmax())
    return token, float(torch.log_softmax(logits, -1)[token])


def checkpoint_bytes(model_dir: Path, prefixes: tuple[str, ...] = ("",)) -> int:
    tensors = load_file(model_dir / "model.safetensors")
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if name.startswith(prefixes))


def serve_full_model(stage: StageProcess, models) -> None:
    """Make sure the stage holds the whole untied model (one stage: first and last)."""
    if stage.holds_full_model:
        return
    stage.assign(models["untied"][0], [0, 2])
    ready = stage.broker.expect(protocol.READY)
    assert ready["epoch"] == stage.epoch
    stage.holds_full_model = True


def assert_serves_prompt(stage: StageProcess, models, step: int, slot: int = 1) -> None:
    """A fresh prompt in `slot` comes back with the reference model's greedy next token."""
    stage.send_frames(step_frames(stage.epoch, [[slot, 0, len(PROMPT), 1, {}]], PROMPT, mb=1, step=step))
    result = stage.result()
    header = result.header
    assert (header["kind"], header["mb"], header["step"], header["attempt"], header["epoch"]) == (
        protocol.RESULT, 1, step, 0, stage.epoch)
    token, logprob = reference_next(models["untied"][1], PROMPT)
    ((got_slot, got_token, got_logprob),) = header["tokens"]
    assert (got_slot, got_token) == (slot, token)
    assert got_logprob == pytest.approx(logprob, abs=1e-4)
    assert result.tensors == {}


# -- registration and assignment ------------------------------------------------------------------

def test_stage_registers_with_its_description(stage: StageProcess) -> None:
    header = stage.registered()
    assert stage.broker.identity == b"s0"
    assert header["name"] == "s0"
    assert (header["device"], header["dtype"], header["threads"], header["memory_budget"]) == ("cpu", "float32", 1,
                                                                                              None)
    assert header["pid"] == stage.process.pid
    assert header["host"] == socket.gethostname()
    assert header["data_address"].startswith("tcp://127.0.0.1:")
    assert int(header["data_address"].rsplit(":", 1)[1]) > 0


def test_bad_assignment_reports_failure_and_the_stage_stays_up(stage: StageProcess, models, tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    stage.assign(missing, [0, 2], epoch=stage.epoch + 1)
    failure = stage.broker.expect(protocol.FAILURE)
    assert failure["epoch"] == stage.epoch
    assert "ModelDirError" in failure["error"]
    assert f"model directory {missing} does not exist" in failure["error"]
    assert "step" not in failure
    stage.broker.expect(protocol.HEARTBEAT, timeout_s=5)  # still alive and talking
    assert stage.process.poll() is None
    serve_full_model(stage, models)  # a good assignment after the bad one still loads


def test_layers_beyond_the_model_are_a_failure(stage: StageProcess, models) -> None:
    stage.assign(models["untied"][0], [0, 3])
    failure = stage.broker.expect(protocol.FAILURE)
    assert "layer range [0, 3) is beyond the model's 2 layers" in failure["error"]
    serve_full_model(stage, models)


SPANS = {
    "whole untied model": ("untied", [0, 2], True, True, ("",)),
    "whole tied model: shared head counted once": ("tied", [0, 2], True, True, ("",)),
    "first layer of two: embedding + layer 0": ("untied", [0, 1], True, False,
                                               ("model.embed_tokens.", "model.layers.0.")),
    "last layer of two: layer 1 + norm + head": ("untied", [1, 2], False, True,
                                                ("model.layers.1.", "model.norm.", "lm_head.")),
    "middle stage: one layer alone": ("untied", [1, 2], False, False, ("model.layers.1.",)),
}


@pytest.mark.parametrize("model, layers, is_first, is_last, prefixes", SPANS.values(), ids=SPANS.keys())
def test_param_bytes_are_exactly_what_the_span_needs(stage: StageProcess, models, model, layers, is_first, is_last,
                                                     prefixes) -> None:
    model_dir = models[model][0]
    stage.assign(model_dir, layers, is_first, is_last)
    ready = stage.broker.expect(protocol.READY)
    assert (ready["epoch"], ready["layers"]) == (stage.epoch, layers)
    assert ready["param_bytes"] == checkpoint_bytes(model_dir, prefixes)
    assert ready["load_s"] >= 0 and ready["peak_rss"] > 0


@pytest.mark.parametrize("hint, capacity", [(None, 128), (300, 300), (5000, 1024)],
                         ids=["no hint: 128 positions, grown as needed", "the job's longest sequence",
                              "capped by max_context"])
def test_the_kv_cache_is_made_as_long_as_the_context_hint_at_load(stage: StageProcess, models, hint,
                                                                   capacity) -> None:
    stage.assign(models["untied"][0], [0, 2], max_context=1024, **({} if hint is None else {"context_hint": hint}))
    assert stage.broker.expect(protocol.READY)["epoch"] == stage.epoch
    heartbeat = stage.broker.expect(protocol.HEARTBEAT, timeout_s=5)
    while heartbeat["epoch"] != stage.epoch:  # one sent before the assignment
        heartbeat = stage.broker.expect(protocol.HEARTBEAT, timeout_s=5)
    assert heartbeat["stats"]["kv_capacity"] == capacity


@pytest.mark.parametrize("hint", [-1, "300", 2.5, True])
def test_a_context_hint_that_is_not_a_count_fails_the_assignment(stage: StageProcess, models, hint) -> None:
    stage.assign(models["untied"][0], [0, 2], context_hint=hint)
    failure = stage.broker.expect(protocol.FAILURE)
    assert f"context_hint must be an integer >= 0, got {hint!r}" in failure["error"]
    serve_full_model(stage, models)


def test_tied_last_stage_without_the_embedding_loads_the_head_from_it(stage: StageProcess, models) -> None:
    model_dir = models["tied"][0]
    stage.assign(model_dir, [1, 2], is_first=False, is_last=True)
    ready = stage.broker.expect(protocol.READY)
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")
    assert ready["param_bytes"] == checkpoint_bytes(model_dir, ("model.layers.1.", "model.norm.",
                                                                "model.embed_tokens."))


def test_failed_assignment_does_not_serve_its_epoch(fleet, models) -> None:
    stage = fleet["bad-next-hop"]
    stage.registered()
    stage.broker.send(protocol.ASSIGN, epoch=5, model_dir=str(models["untied"][0]), layers=[0, 2], is_first=True,
                      is_last=True, next_address="not-an-endpoint", num_slots=NUM_SLOTS, max_context=MAX_CONTEXT)
    failure = stage.broker.expect(protocol.FAILURE)
    assert failure["epoch"] == 5 and "not-an-endpoint" in failure["error"]
    stage.send_frames(step_frames(5, [[0, 0, len(PROMPT), 1, {}]], PROMPT))
    rejected = stage.broker.expect(protocol.REJECTED, timeout_s=3)
    assert "epoch" in rejected["error"] or "assigned" in rejected["error"]
    stage.broker.expect(protocol.HEARTBEAT, timeout_s=3)


# -- serving --------------------------------------------------------------------------------------

def test_step_then_decode_match_the_reference_model(stage: StageProcess, models) -> None:
    serve_full_model(stage, models)
    model = models["untied"][1]
    stage.send_frames(step_frames(stage.epoch, [[0, 0, len(PROMPT), 1, {}]], PROMPT, mb=0, step=10))
    first = stage.result().header
    expected, logprob = reference_next(model, PROMPT)
    assert first["tokens"][0][:2] == [0, expected]
    assert first["tokens"][0][2] == pytest.approx(logprob, abs=1e-4)
    assert first["scores"] == []
    stage.send_frames(step_frames(stage.epoch, [[0, len(PROMPT), 1, 1, {}]], [expected], mb=0, step=11))
    second = stage.result().header
    assert second["step"] == 11
    assert second["tokens"][0][:2] == [0, reference_next(model, PROMPT + [expected])[0]]


def test_non_emitting_rows_return_no_token_and_targets_are_scored(stage: StageProcess, models) -> None:
    serve_full_model(stage, models)
    targets = PROMPT[1:] + [3]
    stage.send_frames(step_frames(stage.epoch, [[2, 0, 3, 0, {}], [3, 0, len(PROMPT), 0, {}, targets]],
                                  PROMPT[:3] + PROMPT, step=12))
    header = stage.result().header
    assert header["tokens"] == []
    ((slot, scores, greedy),) = header["scores"]
    with torch.no_grad():
        logits = models["untied"][1](torch.tensor([PROMPT])).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(len(PROMPT)), torch.tensor(targets)]
    assert slot == 3 and scores == pytest.approx(expected.tolist(), abs=1e-4)
    assert greedy == (logits.argmax(-1) == torch.tensor(targets)).tolist()


def malformed_cases() -> dict:
    def valid(stage: StageProcess) -> list:
        return step_frames(stage.epoch, [[1, 0, len(PROMPT), 1, {}]], PROMPT)

    return {
        "garbage bytes": (lambda s: [b"\x00\xffnot a header at all"], r"header is not valid JSON"),
        "truncated: tensor frame dropped": (lambda s: valid(s)[:1],
                                            r"header announces 1 tensor frame\(s\) but 0 arrived"),
        "padded: extra frame": (lambda s: [*valid(s), b"12345678"], r"header announces 1 tensor frame\(s\) but 2"),
        "short tensor frame": (lambda s: [valid(s)[0], bytes(valid(s)[1])[:-3]],
                               r"needs 48 bytes, frame has 45"),
        "tokens of the wrong dtype": (
            lambda s: encode({"kind": "step", "mb": 0, "step": 0, "attempt": 0, "epoch": s.epoch,
                              "rows": [[1, 0, 6, 1, {}]], "release": []},
                             {"tokens": torch.tensor(PROMPT, dtype=torch.float32)}),
            r"'tokens' must be int64 \[N\], got torch.float32 \[6\]"),
        "wrong epoch": (lambda s: step_frames(s.epoch + 7, [[1, 0, 6, 1, {}]], PROMPT),
                        r"step of epoch \d+ but this stage serves epoch \d+"),
        "not a step": (lambda s: encode({"kind": "result", "mb": 0}), r"data message of kind 'result'"),
        "missing field": (lambda s: encode({"kind": "step", "mb": 0, "step": 0, "epoch": s.epoch, "rows": [],
                                            "release": []}, {"tokens": torch.tensor([1])}),
                          r"step header field 'attempt' must be int"),
        "rows do not cover the tokens": (lambda s: step_frames(s.epoch, [[1, 0, 5, 1, {}]], PROMPT),
                                         r"rows cover 5 positions, tensor has 6"),
        "malformed row": (lambda s: step_frames(s.epoch, [[1, 0, 6, 1]], PROMPT),
                          r"step row must be \[slot, start, length, emit, sampling"),
        "hidden instead of tokens": (
            lambda s: encode({"kind": "step", "mb": 0, "step": 0, "attempt": 0, "epoch": s.epoch,
                              "rows": [[1, 0, 1, 1, {}]], "release": []}, {"hidden": torch.zeros(1, 64)}),
            r"step for this stage must carry exactly one tensor 'tokens', got \['hidden'\]"),
    }


MALFORMED = malformed_cases()


@pytest.mark.parametrize("make_frames, error", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_step_is_rejected_and_the_next_one_served(stage: StageProcess, models, make_frames,
                                                             error: str) -> None:
    serve_full_model(stage, models)
    stage.send_frames(make_frames(stage))
    rejected = stage.broker.expect(protocol.REJECTED)
    assert rejected["sender"] == "127.0.0.1"
    assert re.search(error, rejected["error"]), rejected["error"]
    assert not stage.results.poll(0)  # nothing was passed on
    assert_serves_prompt(stage, models, step=20)


def test_oversized_step_is_rejected_and_the_next_one_served(fleet, models) -> None:
    stage = fleet["oversized"]  # started with --max-message-bytes 1KiB
    serve_full_model(stage, models)
    stage.send_frames(step_frames(stage.epoch, [[1, 0, 200, 1, {}]], [5] * 200))  # 1,600 bytes of tokens alone
    rejected = stage.broker.expect(protocol.REJECTED)
    assert re.search(r"message of \d+ bytes exceeds the limit of 1024 bytes", rejected["error"]), rejected["error"]
    assert not stage.results.poll(0)
    assert_serves_prompt(stage, models, step=21)


FAILING_STEPS = {
    "slot outside the stage": ([[NUM_SLOTS, 0, 6, 1, {}]], PROMPT, r"ValueError: slot 4 is outside this stage's 4 slots"),
    "start past the cache": ([[2, 40, 6, 1, {}]], PROMPT, r"ValueError: slot 2: step starts at position 40 but only"),
    "token outside the vocabulary": ([[2, 0, 6, 1, {}]], PROMPT[:5] + [1000], r"IndexError"),
    "past the context": ([[2, 0, MAX_CONTEXT + 1, 1, {}]], [1] * (MAX_CONTEXT + 1),
                         r"ValueError: position 65 exceeds the context budget of 64 tokens"),
}


@pytest.mark.parametrize("rows, token_ids, error", FAILING_STEPS.values(), ids=FAILING_STEPS.keys())
def test_step_that_cannot_run_is_reported_as_a_failure(stage: StageProcess, models, rows, token_ids,
                                                       error: str) -> None:
    serve_full_model(stage, models)
    stage.send_frames(step_frames(stage.epoch, rows, token_ids, mb=2, step=30))
    failure = stage.broker.expect(protocol.FAILURE)
    assert (failure["epoch"], failure["mb"], failure["step"]) == (stage.epoch, 2, 30)
    assert re.search(error, failure["error"]), failure["error"]
    assert_serves_prompt(stage, models, step=31)


HOSTILE = {
    "nested-json": ([b'{"v": 1, "kind": "step", "pad": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
                    "wire/frames.py _parse_header: json.loads raises RecursionError, which is not turned into a "
                    "WireError, so StageWorker._serve_one does not catch it and the stage process dies"),
    "huge-dim": ([encode({"kind": "step"})[0].replace(
                     b'"tensors":[]', b'"tensors":[{"name":"tokens","dtype":"int64","shape":[18446744073709551616,0]}]'),
                  b""],
                 "wire/frames.py decode: a zero-element shape with a dim >= 2**63 passes the byte check, then "
                 "torch.empty(shape) raises TypeError, which StageWorker._serve_one does not catch"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_header_is_rejected_without_killing_the_stage(fleet, name: str) -> None:
    stage = fleet[name]
    stage.registered()
    frames = HOSTILE[name][0]
    stage.send_frames(frames)
    deadline = time.monotonic() + 10
    while stage.process.poll() is None and time.monotonic() < deadline:
        message = stage.broker.receive(0.2)
        if message is not None and message.kind == protocol.REJECTED:
            assert message.header["sender"] == "127.0.0.1"
            stage.broker.expect(protocol.HEARTBEAT, timeout_s=5)
            assert stage.process.poll() is None
            return
    raise AssertionError(f"no 'rejected'; stage exit code {stage.process.poll()}\n{stage.log_tail()}")


# -- lifecycle ------------------------------------------------------------------------------------

def test_sigterm_stops_the_stage_with_a_bye(fleet) -> None:
    stage = fleet["sigterm"]
    stage.registered()
    stage.broker.expect(protocol.HEARTBEAT, timeout_s=5)  # the main loop is running
    stage.process.send_signal(signal.SIGTERM)
    bye = stage.broker.expect(protocol.BYE, timeout_s=5)
    assert stage.wait_exit(5.0) == 128 + signal.SIGTERM  # stopped by a signal, as shells report it
    assert bye["stats"]["steps"] == 0 and bye["stats"]["rejected"] == 0


def test_stage_exits_by_itself_when_the_broker_goes_silent(tmp_path, models) -> None:
    context = zmq.Context()
    stage = StageProcess(context, tmp_path, "orphan", "--broker-timeout", "2")
    try:
        stage.assign(models["untied"][0], [0, 1], is_first=True, is_last=False)
        ready = stage.broker.expect(protocol.READY, timeout_s=REGISTER_TIMEOUT_S)
        assert ready["param_bytes"] == checkpoint_bytes(models["untied"][0], ("model.embed_tokens.",
                                                                              "model.layers.0."))
        stage.broker.router.close(linger=0)  # the broker is gone: nothing more is heard
        assert stage.wait_exit(30.0) == 3  # a generous bound: load may slow it, not make it wrong
        assert time.monotonic() - stage.assigned_at >= 2.0  # it waited out --broker-timeout after the assignment
        assert "silent for" in stage.log_path.read_text()
    finally:
        stage.stop()
        context.destroy(linger=0)


# -- the broker's end of the control plane --------------------------------------------------------

@pytest.fixture
def control_plane():
    context = zmq.Context()
    plane = ControlPlane(context)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"intruder")
    dealer.connect(plane.address)
    yield plane, dealer
    context.destroy(linger=0)


def poll_until_quiet(plane: ControlPlane) -> list:
    events = plane.poll(2000)
    return events + plane.poll(200)


def test_control_plane_ignores_malformed_and_unregistered_messages(control_plane) -> None:
    plane, dealer = control_plane
    dealer.send_multipart([b"not json"])
    dealer.send_multipart(encode({"kind": protocol.FAILURE, "error": "boom"}))  # never registered
    dealer.send_multipart(encode({"kind": protocol.REGISTER, "name": "x"}))  # missing fields
    assert poll_until_quiet(plane) == []
    assert plane.stages == {}


def test_control_plane_survives_a_deeply_nested_header(control_plane) -> None:
    plane, dealer = control_plane
    dealer.send_multipart([b'{"v": 1, "kind": "register", "pad": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
    assert poll_until_quiet(plane) == []
