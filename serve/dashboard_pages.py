"""The dashboard's HTML: the layout every page shares, and each page's body from its data. Pure string building
(every value escaped); the routes that gather the data are serve/dashboard.py's, the pictures serve/svg_charts.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from html import escape
from urllib.parse import quote

from layerbus.storage.status_records import JobEvent, JobStatus

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
nav a { margin-right: 1em; } table { border-collapse: collapse; margin: .5em 0 1em; }
td, th { padding: .25em .6em; border-bottom: 1px solid #ddd; text-align: left; font-size: 14px; }
.bar { width: 140px; height: 10px; background: #eee; display: inline-block; vertical-align: middle; }
.bar span { display: block; height: 10px; background: #2a6fdb; } .muted { color: #777; }
.error { color: #b00020; } .chart, .chain { display: block; margin: .5em 0 1em; overflow: visible; }
"""
# The live part of a page is fetched again every this many milliseconds.
REFRESH_MS = 2000


def layout(title: str, body: str, live_url: str | None = None) -> str:
    script = ""
    if live_url:
        script = (f"<script>setInterval(function () {{ fetch({live_url!r}, {{credentials: 'same-origin'}})"
                  ".then(function (r) { return r.ok ? r.text() : null; })"
                  ".then(function (t) { if (t !== null) { document.getElementById('live').innerHTML = t; } })"
                  f".catch(function () {{}}); }}, {REFRESH_MS});</script>")
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)} · layerbus</title>"
            f"<link rel=\"icon\" href=\"data:,\"><style>{STYLE}</style></head><body>"
            f"<nav><a href=\"/\">jobs</a><a href=\"/evals\">evals</a><a href=\"/logout\">log out</a></nav>"
            f"<h1>{escape(title)}</h1>{body}{script}</body></html>")


def login_page(message: str | None = None) -> str:
    said = f'<p class="error">{escape(message)}</p>' if message else ""
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>log in · layerbus</title>"
            f"<link rel=\"icon\" href=\"data:,\"><style>{STYLE}</style></head><body><h1>layerbus</h1>{said}"
            "<form method=\"post\" action=\"/login\"><label>API key <input type=\"password\" name=\"key\" "
            "autocomplete=\"off\" size=\"50\"></label> <button type=\"submit\">log in</button></form>"
            "<p class=\"muted\">A key made with <code>layerbus keys api new NAME</code> on the server's store.</p>"
            "</body></html>")


def progress_bar(job: JobStatus) -> str:
    done = job.completed + job.failed + job.cancelled
    share = done / job.total if job.total else 0.0
    return (f'<span class="bar" title="{done} of {job.total}"><span style="width:{share * 100:.1f}%"></span></span> '
            f"{done:,} / {job.total:,}")


def eta(job: JobStatus) -> str:
    if job.eta_s is None:
        return "-"
    minutes, seconds = divmod(int(job.eta_s), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {seconds:02d}s"


def jobs_table(jobs: Sequence[JobStatus]) -> str:
    if not jobs:
        return '<p class="muted">No jobs in the store yet: <code>layerbus submit</code> or POST /v1/batches.</p>'
    rows = "".join(
        f'<tr class="job"><td><a href="/jobs/{quote(j.job_id)}">{escape(j.job_id)}</a></td><td>{escape(j.name)}</td>'
        f"<td>{escape(j.status)}</td><td>{progress_bar(j)}</td><td>{j.failed:,}</td>"
        f"<td>{'-' if j.tokens_per_s is None else f'{j.tokens_per_s:.1f}'}</td><td>{eta(j)}</td>"
        f"<td>{escape(j.model.rstrip('/').rsplit('/', 1)[-1])}</td><td>{_when(j.timestamps.get('created_at'))}</td></tr>"
        for j in jobs)
    return ("<table id=\"jobs\"><tr><th>job</th><th>name</th><th>status</th><th>progress</th><th>failed</th>"
            f"<th>tokens/s</th><th>ETA</th><th>model</th><th>created (UTC)</th></tr>{rows}</table>")


def job_summary(job: JobStatus) -> str:
    error = f'<p class="error">{escape(job.error)}</p>' if job.error else ""
    return (f"<p>status <b>{escape(job.status)}</b> · {progress_bar(job)} · {job.failed:,} failed · "
            f"{job.cancelled:,} cancelled · ETA {eta(job)} · "
            f"{'-' if job.tokens_per_s is None else f'{job.tokens_per_s:.1f}'} tokens/s · model "
            f"{escape(job.model)}</p>{error}")


def events_table(events: Sequence[JobEvent]) -> str:
    if not events:
        return '<p class="muted">No events yet.</p>'
    rows = "".join(f"<tr class=\"event\"><td>{_when(e.at)}</td><td>{escape(e.kind)}</td><td>{escape(e.message)}</td>"
                   f"<td>{'' if e.duration_s is None else f'{e.duration_s:.2f} s'}</td></tr>" for e in events)
    return f"<table id=\"events\"><tr><th>at (UTC)</th><th>kind</th><th>what happened</th><th>took</th></tr>{rows}</table>"


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S")
