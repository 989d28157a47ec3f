"""The dashboard's web server: a thread reads the swarm every ``READ_SECONDS`` (one DHT read, through
``read``) and prepares what the page shows; uvicorn serves it from a thread of its own. Requests only copy
the last prepared figures, so neither a slow reader nor a slow client ever waits on the network or blocks
a training peer. Read-only: every route is a GET.

Routes: ``/`` (the page and its ``/static`` script and style), ``/api/dashboard`` (what the page draws),
``/api/status`` (the ``spes status --json`` summary), ``/metrics`` (Prometheus' text format).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from importlib import resources

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spes_p2p.dashboard.charts import line_chart
from spes_p2p.dashboard.history import SwarmHistory
from spes_p2p.dashboard.prometheus import SwarmCollector
from spes_p2p.errors import SpesError

logger = logging.getLogger(__name__)

READ_SECONDS = 3.0  # between reads of the swarm's records
START_SECONDS = 10.0  # bound on the server's start
ASSETS = {"page.js": "text/javascript", "page.css": "text/css"}
HEADERS = {  # the page runs only its own script: text from peers' records is never markup
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class Dashboard:
    """The swarm's page on ``host:port`` (port 0: one the system picks), fed by ``read`` (a summary, as
    ``spes status --json`` prints it; it raises when the swarm cannot be read). Use as a context manager,
    or ``start`` and ``stop``."""

    def __init__(self, read: Callable[[], dict], host: str = "127.0.0.1", port: int = 0) -> None:
        self.read, self.host, self.port = read, host, port
        self.history = SwarmHistory()
        self.url = ""
        self._lock = threading.Lock()
        self._summary: dict | None = None
        self._page: dict = {"status": None, "error": "reading the swarm...", "history": self.history.view()}
        self._stop = threading.Event()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(SwarmCollector(self._latest))
        self._server = uvicorn.Server(
            uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        )
        self._threads: list[threading.Thread] = []
        self._socket: socket.socket | None = None

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        """Binds the port (a SpesError when it cannot), then starts reading and serving; returns the URL."""
        try:
            sock = socket.create_server((self.host, self.port))
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise SpesError(
                f"cannot serve the dashboard on {self.host}:{self.port}: {why}; choose another port (or host)"
            ) from None
        self._socket, self.port = sock, sock.getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}/"
        self._threads = [
            threading.Thread(target=self._watch, name="dashboard-read", daemon=True),
            threading.Thread(
                target=self._server.run, kwargs={"sockets": [sock]}, name="dashboard", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self._server.started and self._threads[1].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._server.started:
            self.stop()
            raise SpesError(f"the dashboard's server did not start on {self.url} within {START_SECONDS:.0f}s")
        return self.url

    def stop(self) -> None:
        self._stop.set()
        self._server.should_exit = True
        for thread in self._threads:
            thread.join(timeout=START_SECONDS)
        if self._socket is not None:
            self._socket.close()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # figures nobody foresaw: logged, and the page goes on with the next read
                logger.exception("preparing the dashboard's figures failed")
            self._stop.wait(READ_SECONDS)

    def refresh(self) -> None:
        """One read of the swarm: the figures the page and the API serve until the next."""
        try:
            summary, error = self.read(), None
        except Exception as exc:  # the swarm unreadable now (nobody alive, a DHT timeout): shown on the page
            summary, error = None, str(exc) or type(exc).__name__
            logger.debug("reading the swarm failed", exc_info=True)
        if summary is not None:
            self.history.add(summary, time.time())
        history = self.history.view()
        page = {
            "status": summary,
            "error": error,
            "updated": time.time(),
            "history": history,
            "charts": _charts(history),
        }
        with self._lock:
            self._summary, self._page = summary, page

    def _latest(self) -> tuple[dict | None, dict]:
        with self._lock:
            return self._summary, self._page["history"]

    def _app(self) -> Starlette:
        def page(request: Request) -> Response:
            return _asset("page.html", "text/html")

        def asset(request: Request) -> Response:
            name = request.path_params["name"]
            return _asset(name, ASSETS[name]) if name in ASSETS else Response("not found", 404)

        def dashboard(request: Request) -> Response:
            with self._lock:
                return JSONResponse(self._page, headers=HEADERS)

        def status(request: Request) -> Response:
            with self._lock:
                summary, error = self._summary, self._page["error"]
            if summary is None:
                return JSONResponse({"error": error}, status_code=503, headers=HEADERS)
            return JSONResponse(summary, headers=HEADERS)

        def metrics(request: Request) -> Response:
            return Response(generate_latest(self._registry), headers=HEADERS, media_type=CONTENT_TYPE_LATEST)

        return Starlette(
            routes=[
                Route("/", page),
                Route("/static/{name}", asset),
                Route("/api/dashboard", dashboard),
                Route("/api/status", status),
                Route("/metrics", metrics),
            ]
        )


def _asset(name: str, media_type: str) -> Response:
    body = resources.files("spes_p2p.dashboard").joinpath(name).read_bytes()
    return Response(body, media_type=media_type, headers=HEADERS)


def _charts(history: dict) -> dict[str, str]:
    rounds = history["rounds"]
    return {
        "loss": line_chart(
            "Loss over rounds (the median peer at each round)",
            {
                "training": list(zip(rounds, history["loss"], strict=True)),
                "validation": list(zip(rounds, history["val_loss"], strict=True)),
            },
        ),
        "traffic": line_chart(
            "Traffic per round (all peers)",
            {
                "sent": list(zip(rounds, history["sent"], strict=True)),
                "received": list(zip(rounds, history["received"], strict=True)),
            },
            unit="B",
        ),
    }
