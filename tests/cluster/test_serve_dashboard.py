"""The dashboard in headless Chromium (Debian's `chromium`), served by `layerbus serve` over a store where a broker
and two stages ran a job on the tiny llama and a suite has four recorded eval runs (the fourth with another
fingerprint): each page loads with no message on the browser's console, a screenshot of each is written under the
test's folder, the job page's DOM holds the chain's stages, and the suite's history holds a point per run with its
interval and the fingerprint change marked. And the browser login: a page without a key goes to /login, a wrong
key is refused there, a right one is kept in an HttpOnly cookie."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from layerbus.storage import JobStore
from tests.helpers.cli import cli_env, layerbus, layerbus_executable, write_jsonl
from tests.helpers.eval_runs import BASE, ACC_ONLY, flipped, mc_task, record_run, T0
from tests.helpers.processes import free_port_pair
from tests.helpers.serve_server import make_key, serve

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (run_tests.sh installs it as root)")
TIMEOUT_S = 240


def browse(url: str, screenshot: Path) -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the console's messages) of one page, and its screenshot."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    shot = subprocess.run([*flags, f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=120)
    console = [line for line in (dom.stderr + shot.stderr).splitlines() if ":CONSOLE" in line]
    assert dom.returncode == 0 and screenshot.is_file(), dom.stderr[-2000:] + shot.stderr[-2000:]
    return dom.stdout, console


@pytest.fixture(scope="module")
def ran(tmp_path_factory, tiny_models):
    """A store with a finished 2-stage job (its stage snapshots kept) and four nightly eval runs."""
    model = tiny_models("llama")
    folder = tmp_path_factory.mktemp("dashboard")
    home, db, port = folder / "home", f"sqlite:///{folder / 'jobs.db'}", free_port_pair()
    with JobStore.open(db) as store:
        nights = [BASE, flipped(BASE, lose=[0, 1]), flipped(BASE, gain=[60]), flipped(BASE, lose=[2, 3, 4])]
        runs = [record_run(store, folder, mc_task("mc", night), ACC_ONLY, created_at=T0.replace(day=2 + i),
                           **({"dtype": "bfloat16"} if i == 3 else {})) for i, night in enumerate(nights)]
    corpus = write_jsonl(folder / "docs.jsonl", [{"id": f"d-{i}", "text": f"Stage {i} sends on."} for i in range(24)])
    submitted = layerbus(home, "submit", corpus, "--task", "summarize", "--model", model, "--db", db,
                         "--max-new-tokens", "8", "--name", "dashboard-job")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    logs = [folder / name for name in ("broker.log", "stage-0.log", "stage-1.log")]
    commands = [["broker", "--model", str(model), "--stages", "2", "--db", db, "--job", job_id, "--bind-control",
                 f"tcp://127.0.0.1:{port}", "--bind-results", f"tcp://127.0.0.1:{port + 1}", "--poll", "0.2"]] + [
                ["stage", "--broker", f"tcp://127.0.0.1:{port}", "--name", f"stage-{i}", "--threads", "1"]
                for i in range(2)]
    processes = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as handle:
                processes.append(subprocess.Popen([layerbus_executable(), "-v", *command], env=cli_env(home),
                                                  stdout=handle, stderr=subprocess.STDOUT))
        code = processes[0].wait(TIMEOUT_S)
        assert code == 0, "\n".join(log.read_text()[-2000:] for log in logs)
    finally:
        for process in processes:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
    with JobStore.open(db) as store:
        assert len(store.stage_snapshots(job_id)) == 2, "the broker's last look at its stages is kept"
    return {"home": home, "db": db, "folder": folder, "job_id": job_id, "runs": runs}


def test_every_page_loads_in_chromium_without_console_messages(ran, tmp_path):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    runs = ran["runs"]
    compare = "/evals/compare?" + urllib.parse.urlencode({"base": runs[0].job_id, "cand": runs[1].job_id})
    pages = {"jobs": "/", "job": f"/jobs/{ran['job_id']}", "evals": "/evals", "history": "/evals/history?suite=nightly",
             "compare": compare}
    with serve(ran["home"], ran["db"], ran["folder"] / "serve.log") as server:
        seen = {name: browse(server.url + path, shots / f"{name}.png") for name, path in pages.items()}

    for name, (dom, console) in seen.items():
        assert console == [], f"{name}: {console}"
        assert "not found" not in dom and "log in" not in dom.split("<nav>")[0], name
    assert ran["job_id"] in seen["jobs"][0] and "dashboard-job" in seen["jobs"][0]
    job_dom = seen["job"][0]
    assert re.findall(r'class="stage" data-stage="(stage-\d)"', job_dom) == ["stage-0", "stage-1"]
    assert "layers [0, " in job_dom and "busy " in job_dom and 'class="event"' in job_dom
    history = seen["history"][0]
    assert history.count('class="point"') == 4 and history.count('class="interval"') == 4
    assert history.count('class="fingerprint-change"') == 1, "the fourth run changed dtype"
    assert f'cand={runs[1].job_id}' in history.replace("&amp;", "&"), "a point links to its compare"
    compared = seen["compare"][0]
    assert compared.count('class="flip"') == 2 and "q000" in compared and "lost" in compared
    assert sorted(p.name for p in shots.iterdir()) == sorted(f"{name}.png" for name in pages)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None


def _get(opener, url: str, data: bytes | None = None, cookie: str | None = None) -> tuple[int, dict, str]:
    request = urllib.request.Request(url, data=data, headers={"Cookie": cookie} if cookie else {})
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def test_the_browser_logs_in_with_a_key(tmp_path):
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    key = make_key(home, db, "alice")
    opener = urllib.request.build_opener(_NoRedirect)
    with serve(home, db, tmp_path / "serve.log") as server:
        anonymous = _get(opener, server.url + "/")
        wrong = _get(opener, server.url + "/login", b"key=lb-wrong")
        right = _get(opener, server.url + "/login", urllib.parse.urlencode({"key": key}).encode())
        cookie = right[1].get("set-cookie", "")
        inside = _get(opener, server.url + "/", cookie=cookie.split(";")[0])

    assert anonymous[0] == 303 and anonymous[1]["location"] == "/login"
    assert wrong[0] == 401 and "is not a key of this server" in wrong[2]
    assert right[0] == 303 and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert inside[0] == 200 and "No jobs in the store yet" in inside[2]
