"""The dashboard's routes: the jobs with their progress and ETA, a job's events, tokens/s chart and chain of stages
(its live part fetched again every two seconds), the eval suites' histories and compares, and a browser login
with an API key (kept in an HttpOnly cookie). Behind the same keys as the API; every valid key sees every job."""

from __future__ import annotations

from html import escape
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from layerbus.serve.auth import COOKIE, authenticate
from layerbus.serve.dashboard_evals import compare_page, history_page, read_comparison, suites_page
from layerbus.serve.dashboard_pages import events_table, job_summary, jobs_table, layout, login_page
from layerbus.serve.errors import ApiError
from layerbus.serve.server import Server
from layerbus.serve.svg_charts import chain_picture, rate_chart
from layerbus.storage.errors import StoreError

router = APIRouter()
# Jobs the front page lists, newest first; runs a history chart shows.
JOBS_SHOWN = 50
RUNS_SHOWN = 30


def _server(request: Request) -> Server:
    return request.app.state.server


def _page(request: Request, build) -> Response:  # type: ignore[no-untyped-def]
    """The page `build(server)` makes, for a caller with a valid key; the login page otherwise."""
    server = _server(request)
    try:
        server.caller(request)
    except ApiError:
        return RedirectResponse("/login", status_code=303)
    try:
        title, body, live = build(server)
    except (StoreError, ValueError) as error:
        return HTMLResponse(layout("not found", f'<p class="error">{escape(str(error))}</p>'), status_code=404)
    return HTMLResponse(layout(title, body, live))


@router.get("/login")
def login_form() -> HTMLResponse:
    return HTMLResponse(login_page())


@router.post("/login")
async def login(request: Request) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    key = (form.get("key") or [""])[0].strip()
    try:
        authenticate(_server(request).api, key or None, "required")
    except ApiError as error:
        return HTMLResponse(login_page(error.message), status_code=401)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, key, httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response


@router.get("/logout")
def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE)
    return response


@router.get("/")
def jobs(request: Request) -> Response:
    return _page(request, lambda server: ("jobs", jobs_table(server.store.list_jobs(limit=JOBS_SHOWN)), None))


def _job_live(server: Server, job_id: str) -> str:
    job = server.store.job_status(job_id)
    stages = server.store.stage_snapshots(job_id)
    chain = chain_picture(stages) if stages else '<p class="muted">No stages are working on this job now.</p>'
    return (job_summary(job) + "<h2>chain</h2>" + chain + "<h2>tokens/s</h2>"
            + rate_chart(server.token_samples.rates(job_id)))


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str) -> Response:
    def build(server: Server):  # type: ignore[no-untyped-def]
        live = _job_live(server, job_id)
        events = events_table(server.store.job_events(job_id))
        return f"job {job_id}", f'<div id="live">{live}</div><h2>events</h2>{events}', f"/jobs/{job_id}/live"

    return _page(request, build)


@router.get("/jobs/{job_id}/live")
def job_live(request: Request, job_id: str) -> Response:
    server = _server(request)
    server.caller(request)
    try:
        return HTMLResponse(_job_live(server, job_id))
    except StoreError as error:
        return HTMLResponse(f'<p class="error">{escape(str(error))}</p>', status_code=404)


@router.get("/evals")
def evals(request: Request) -> Response:
    return _page(request, lambda server: ("eval suites", suites_page(server.store.eval_runs(limit=1000)), None))


@router.get("/evals/history")
def eval_history(request: Request, suite: str = "") -> Response:
    def build(server: Server):  # type: ignore[no-untyped-def]
        history = server.store.eval_history(suite, limit=RUNS_SHOWN)
        return f"suite {suite or '(ad-hoc tasks)'}", history_page(suite, history), None

    return _page(request, build)


@router.get("/evals/compare")
def eval_compare(request: Request, base: str, cand: str) -> Response:
    def build(server: Server):  # type: ignore[no-untyped-def]
        base_run, cand_run, comparison, changes = read_comparison(server.store, base, cand)
        return f"compare {base} → {cand}", compare_page(base_run, cand_run, comparison, changes), None

    return _page(request, build)
