"""`layerbus serve` driven by the real `openai` client, against a real broker and stage on the tiny llama: a batch
uploaded, created, polled until completed, its output file parsed into OpenAI's own ChatCompletion and Completion
types; a file with bad lines ends failed naming its lines; cancel; expiry that keeps what completed; list
pagination; keys (missing, wrong, revoked, each key sees its own, an admin sees all); uploads the server refuses
without falling over."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from layerbus.storage import ItemResult, JobStore
from tests.helpers.cli import cli_env, layerbus, layerbus_executable
from tests.helpers.processes import free_port_pair
from tests.helpers.serve_server import make_key, raw_request, serve

TIMEOUT_S = 240


def chat_line(custom_id: str, model: str, content: str, max_tokens: int = 4) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}}


def text_line(custom_id: str, model: str, prompt: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": 3}}


def jsonl(lines: list[dict | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_models):
    """A store with three keys, a server over it, and a broker with one stage serving the tiny llama only."""
    model, idle_model = tiny_models("llama"), tiny_models("llama", seed=7)
    folder = tmp_path_factory.mktemp("serve")
    home, db, port = folder / "home", f"sqlite:///{folder / 'jobs.db'}", free_port_pair()
    keys = {name: make_key(home, db, name, *extra) for name, extra in
            (("alice", ()), ("bob", ()), ("root", ("--admin",)), ("gone", ()))}
    assert layerbus(home, "keys", "api", "revoke", "gone", "--db", db).returncode == 0
    processes: list[subprocess.Popen] = []
    logs = [folder / "broker.log", folder / "stage.log"]
    commands = [["broker", "--model", str(model), "--stages", "1", "--db", db, "--bind-control",
                 f"tcp://127.0.0.1:{port}", "--bind-results", f"tcp://127.0.0.1:{port + 1}", "--poll", "0.2",
                 "--max-context", "96"],
                ["stage", "--broker", f"tcp://127.0.0.1:{port}", "--name", "stage-0", "--threads", "1"]]
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as handle:
                processes.append(subprocess.Popen([layerbus_executable(), "-v", *command], env=cli_env(home),
                                                  stdout=handle, stderr=subprocess.STDOUT))
        with serve(home, db, folder / "serve.log", "--model", str(model), "--model", str(idle_model),
                   "--max-file-lines", "50") as server:
            yield {"server": server, "keys": keys, "db": db, "model": model.name, "idle_model": idle_model.name,
                   "logs": logs}
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


def client(cluster, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster["server"].api, api_key=cluster["keys"][name], max_retries=0)


def wait_for(client_: openai.OpenAI, batch_id: str, statuses: set[str], cluster) -> openai.types.Batch:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        batch = client_.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            logs = "\n".join(path.read_text()[-2000:] for path in cluster["logs"])
            raise AssertionError(f"batch {batch_id} is {batch.status}, not {statuses}:\n{cluster['server'].logs()}\n{logs}")
        time.sleep(0.3)


def create(client_: openai.OpenAI, lines: list[dict | str], endpoint: str = "/v1/chat/completions",
           window: str = "24h", **extra) -> openai.types.Batch:
    uploaded = client_.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    return client_.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=window, **extra)


def test_batches_run_to_completed_and_their_output_parses_as_openai_types(cluster):
    alice, model = client(cluster, "alice"), cluster["model"]
    chat = create(alice, [chat_line(f"chat-{i}", model, f"Name a colour, number {i}.") for i in range(3)] +
                  [chat_line("too-long", model, "word " * 150)], metadata={"suite": "smoke"})
    text = create(alice, [text_line(f"text-{i}", model, f"The stage sends {i}") for i in range(2)],
                  endpoint="/v1/completions")
    assert chat.status == "validating" and chat.metadata == {"suite": "smoke"}

    chat = wait_for(alice, chat.id, {"completed", "failed"}, cluster)
    text = wait_for(alice, text.id, {"completed", "failed"}, cluster)

    assert chat.status == "completed" and text.status == "completed"
    assert chat.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    assert chat.in_progress_at and chat.finalizing_at and chat.completed_at >= chat.created_at
    output = [json.loads(line) for line in alice.files.content(chat.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == ["chat-0", "chat-1", "chat-2"]
    for line in output:
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.choices[0].message.content and body.model == model
    errors = [json.loads(line) for line in alice.files.content(chat.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("too-long", "generation_failed")]
    texts = [json.loads(line) for line in alice.files.content(text.output_file_id).text.splitlines()]
    assert [Completion.model_validate(line["response"]["body"]).object for line in texts] == ["text_completion"] * 2
    assert text.error_file_id is None, "no error file when nothing failed, as OpenAI gives"
    assert alice.files.retrieve(chat.output_file_id).purpose == "batch_output"


def test_a_file_with_bad_lines_fails_naming_each_line(cluster):
    alice, model = client(cluster, "alice"), cluster["model"]
    lines = [chat_line("ok", model, "hi"), "{not json", chat_line("ok", model, "a repeated id"),
             {**chat_line("n", model, "hi"), "body": {**chat_line("n", model, "hi")["body"], "n": 0}},
             text_line("other-endpoint", model, "hi"), chat_line("other-model", "no-such-model", "hi")]

    batch = wait_for(alice, create(alice, lines).id, {"failed", "completed", "in_progress"}, cluster)

    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.request_counts.total == 0 and batch.output_file_id is None
    by_line = {error.line: error.message for error in batch.errors.data}
    assert set(by_line) >= {2, 3, 4}, batch.errors
    assert "JSON" in by_line[2] and "ok" in by_line[3] and "body.n" in by_line[4]


def test_the_lines_name_a_model_the_server_does_not_run(cluster):
    alice = client(cluster, "alice")

    batch = wait_for(alice, create(alice, [chat_line("a", "/etc", "hi")]).id, {"failed"}, cluster)

    assert batch.errors.data[0].code == "model_not_found" and "--model DIR" in batch.errors.data[0].message


def test_cancel_returns_every_request_in_the_error_file(cluster):
    alice = client(cluster, "alice")
    batch = create(alice, [chat_line(f"c-{i}", cluster["idle_model"], "hi") for i in range(3)])
    wait_for(alice, batch.id, {"in_progress"}, cluster)

    cancelling = alice.batches.cancel(batch.id)
    done = wait_for(alice, batch.id, {"cancelled"}, cluster)

    assert cancelling.status in ("cancelling", "cancelled") and done.cancelled_at and done.cancelling_at
    errors = [json.loads(line) for line in alice.files.content(done.error_file_id).text.splitlines()]
    assert [e["error"]["code"] for e in errors] == ["batch_cancelled"] * 3
    with pytest.raises(openai.BadRequestError, match="only a validating or running batch"):
        alice.batches.cancel(batch.id)


def test_expiry_keeps_what_completed_and_expires_the_rest(cluster):
    alice = client(cluster, "alice")
    batch = create(alice, [chat_line(f"e-{i}", cluster["idle_model"], "hi") for i in range(3)], window="10s")
    batch = wait_for(alice, batch.id, {"in_progress"}, cluster)
    with JobStore.open(cluster["db"]) as store:  # a broker of that model would record one item so
        job_id = _job_of(store, batch.id)
        claimed = store.claim_items(job_id, "test:1:a", 1)
        store.complete_items([ItemResult(claimed[0].item_id, "done", "stop", 3, 1, 0.1)])

    done = wait_for(alice, batch.id, {"expired"}, cluster)

    assert done.expired_at is not None and done.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
    output = [json.loads(line) for line in alice.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(line) for line in alice.files.content(done.error_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == ["e-0"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("e-1", "batch_expired"), ("e-2", "batch_expired")]


def _job_of(store: JobStore, batch_id: str) -> str:
    found = store.find_job_by_name(batch_id)
    assert found is not None, f"no job named {batch_id}"
    return found


def test_list_pages_through_a_keys_batches(cluster):
    bob = client(cluster, "bob")
    made = [create(bob, [chat_line("x", "no-such-model", "hi")]).id for _ in range(3)]

    first = bob.batches.list(limit=2)
    every = [batch.id for batch in bob.batches.list(limit=2)]  # the client follows `after` page by page

    assert first.has_more and [b.id for b in first.data] == made[::-1][:2]
    assert every == made[::-1], "newest first, each once, only bob's"


def test_keys_are_required_checked_and_scoped(cluster):
    server, keys = cluster["server"], cluster["keys"]
    alice, bob, root = client(cluster, "alice"), client(cluster, "bob"), client(cluster, "root")
    batch = create(alice, [chat_line("k", "no-such-model", "hi")])

    status, body = raw_request(f"{server.api}/batches/{batch.id}")
    assert status == 401 and body["error"]["code"] == "missing_api_key" and "keys api new" in body["error"]["message"]
    for key in ("lb-wrong", keys["gone"]):
        wrong = openai.OpenAI(base_url=server.api, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError, match="no batch"):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError, match="no file"):
        bob.files.content(batch.input_file_id)
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert batch.input_file_id not in [f.id for f in bob.files.list()]
    assert root.batches.retrieve(batch.id).id == batch.id, "an admin key sees every key's batches"
    alice.files.delete(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(batch.input_file_id)


def test_uploads_the_server_refuses_and_lives_on(cluster):
    server, alice = cluster["server"], client(cluster, "alice")
    auth = {"Authorization": f"Bearer {cluster['keys']['alice']}"}

    wrong_type = raw_request(f"{server.api}/files", "POST", b'{"purpose": "batch"}',
                             {**auth, "Content-Type": "application/json"})
    boundary = "XyZ"
    traversal = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                 f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="../../etc/passwd"\r\n'
                 f'Content-Type: application/jsonl\r\n\r\n{{}}\n\r\n--{boundary}--\r\n').encode()
    form = {**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    traversed = raw_request(f"{server.api}/files", "POST", traversal, form)
    cut_off = raw_request(f"{server.api}/files", "POST", traversal[:-20], form)
    garbage = raw_request(f"{server.api}/files", "POST", b"\x00\xff" * 100, form)
    too_big = raw_request(f"{server.api}/batches", "POST", b"x" * (2 << 20), {**auth, "Content-Type": "application/json"})

    assert wrong_type[0] == 415 and "multipart/form-data" in wrong_type[1]["error"]["message"]
    assert traversed[0] == 400 and traversed[1]["error"]["code"] == "invalid_filename"
    assert cut_off[0] == 400 and garbage[0] == 400
    assert too_big[0] == 413 and too_big[1]["error"]["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError, match="50 lines") as refused:
        alice.files.create(file=("big.jsonl", jsonl([{"n": i} for i in range(60)])), purpose="batch")
    assert refused.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose='batch'"):
        alice.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        create(alice, [chat_line("w", "no-such-model", "hi")], window="forever")
    assert server.alive() and alice.files.list() is not None
    assert "Traceback" not in server.logs()
