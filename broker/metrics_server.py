"""The broker's metrics endpoint (`--metrics HOST:PORT`): Prometheus's text format at /metrics, and
/healthz (200 once the chain is placed and loaded, 503 before and while it is placed again) for
orchestrators, served from a thread of their own.

Nothing is counted for it on the hot path: a custom collector reads the broker's state (the stages'
last heartbeat stats, the placement in use, the broker's counters) and the watched jobs' status in the
store at each scrape, and broker.metrics turns them into families. This is the one module that imports
prometheus_client, and only `--metrics` imports it."""

from __future__ import annotations

import logging
import socket
import threading
from collections import OrderedDict
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from layerbus.broker.metrics import (
    BusySample,
    Family,
    busy_ratio,
    busy_sample,
    chain_ready,
    counter_families,
    job_families,
    remember,
    stage_families,
)
from layerbus.broker.run_state import BrokerCounts

if TYPE_CHECKING:
    from layerbus.broker.broker import Broker
    from layerbus.storage import JobStatus, JobStore

log = logging.getLogger("layerbus.metrics")

WATCHED_JOBS = 32  # the jobs a long-lived broker keeps reporting (the latest), finished ones included


class MetricsError(RuntimeError):
    """The metrics endpoint cannot listen where it was asked to."""


class BrokerCollector:
    """prometheus_client's Collector interface over a broker (attached once it exists) and the jobs it runs."""

    def __init__(self) -> None:
        self.broker: Broker | None = None
        self.jobs: OrderedDict[str, JobStore] = OrderedDict()  # job id -> the store it lives in
        self._busy: dict[str, tuple[BusySample, ...]] = {}  # stage -> busy samples seen at recent scrapes
        self._lock = threading.Lock()  # scrapes may overlap (one thread per request)

    def watch_job(self, store: JobStore, job_id: str) -> None:
        self.jobs[job_id] = store
        self.jobs.move_to_end(job_id)
        while len(self.jobs) > WATCHED_JOBS:
            self.jobs.popitem(last=False)

    def ready(self) -> bool:
        broker = self.broker
        return broker is not None and chain_ready(list(broker.control.stages.values()), broker.placement)

    def collect(self):
        with self._lock:
            families = self._families()
        for family in families:
            yield _prometheus_family(family)

    def _families(self) -> list[Family]:
        families = job_families(self._job_statuses())
        broker = self.broker
        if broker is None:
            return families + counter_families(BrokerCounts(), ready=False, epoch=0)  # not started yet
        stages = list(broker.control.stages.values())  # one copy: the broker's loop may register more meanwhile
        ratios = {}
        for stage in stages:
            now = busy_sample(stage.stats)
            if now is not None:
                history = self._busy.get(stage.name, ())
                ratios[stage.name] = busy_ratio(history, now)
                self._busy[stage.name] = remember(history, now)
        return (families + counter_families(broker.counts, chain_ready(stages, broker.placement), broker.control.epoch)
                + stage_families(stages, broker.placement, broker.control.clock(), ratios))

    def _job_statuses(self) -> list[JobStatus]:
        statuses = []
        for job_id, store in list(self.jobs.items()):
            try:
                statuses.append(store.job_status(job_id))
            except Exception as error:  # noqa: BLE001 - a store that cannot answer now costs its jobs' series, not the scrape
                log.warning("metrics: job %s's status could not be read from %s: %s", job_id, store.url, error)
        return statuses


def _prometheus_family(family: Family):
    if family.kind == "histogram":
        made = HistogramMetricFamily(family.name, family.help, labels=_label_names(family))
        for sample in family.samples:
            made.add_metric([value for _, value in sample.labels], [(_bound(le), count) for le, count in sample.buckets],
                            sum_value=sample.total)
        return made
    kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
    made = kind(family.name, family.help, labels=_label_names(family))
    for sample in family.samples:
        made.add_metric([value for _, value in sample.labels], sample.value)
    return made


def _label_names(family: Family) -> list[str]:
    return [name for name, _ in family.samples[0].labels] if family.samples else []


def _bound(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(le)


class MetricsServer:
    """Serves /metrics and /healthz on `host:port` (port 0: any free one; `address` says which) until closed."""

    def __init__(self, host: str, port: int):
        self.collector = BrokerCollector()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        self._metrics_app = make_wsgi_app(registry)
        try:
            self._server = make_server(host, port, self._app, server_class=_server_class(host),
                                       handler_class=_QuietHandler)
        except OSError as error:  # in use, not an address of this machine, a name that does not resolve
            raise MetricsError(f"cannot serve metrics at {_url(host, port)}: {error.strerror or error}; pick "
                               "another port (or 0 for any free one) or an address of this machine, e.g. "
                               "--metrics 127.0.0.1:9464") from None
        self.address = _url(host, self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="layerbus-metrics", daemon=True)
        self._thread.start()

    def attach(self, broker: Broker) -> None:
        self.collector.broker = broker

    def watch_job(self, store: JobStore, job_id: str) -> None:
        self.collector.watch_job(store, job_id)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _app(self, environ: dict, start_response: Callable):
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            ready = self.collector.ready()
            start_response("200 OK" if ready else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ready: the chain is placed\n" if ready else b"not ready: no chain placed and loaded yet\n"]
        if path in ("/metrics", "/"):
            return self._metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"layerbus serves /metrics and /healthz\n"]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - scrapes every few seconds are not news
        pass


def _server_class(host: str) -> type[WSGIServer]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class ThreadingServer(ThreadingMixIn, WSGIServer):
        address_family = family
        daemon_threads = True  # a scrape in progress never holds the broker's exit

    return ThreadingServer


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
