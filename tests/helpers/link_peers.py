"""A link-probe peer in a thread of the test's process: a PULL socket on a free loopback port answering link
probes with an EchoPeer, as a stage's data port does in its main loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from layerbus.wire import link_probe


@contextmanager
def echo_peer() -> Iterator[str]:
    """Serves until the block ends; gives its address."""
    context = zmq.Context()
    inp = context.socket(zmq.PULL)
    inp.bind("tcp://127.0.0.1:*")
    echo = link_probe.EchoPeer(context)
    stop = threading.Event()
    thread = threading.Thread(target=link_probe.serve, args=(inp, echo, stop.is_set, 20), daemon=True)
    thread.start()
    yield inp.last_endpoint.decode()
    stop.set()
    thread.join(5)
    echo.close()
    inp.close(linger=0)
    context.term()
