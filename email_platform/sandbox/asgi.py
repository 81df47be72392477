"""Serving an ASGI app from a background thread on loopback (sandbox, provider stubs, tests)."""

import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.types import ASGIApp


def bind(host: str, port: int) -> socket.socket:
    # Binding ourselves (rather than letting uvicorn do it) gives the real port before the
    # server starts and leaves no window in which another process could grab it.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_config(app: ASGIApp, shutdown_timeout: float | None, **options: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=shutdown_timeout,
        **options,
    )


class BackgroundServer:
    """Runs an ASGI app in a daemon thread; ``with BackgroundServer(app) as url: ...``."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        shutdown_timeout: float = 2.0,
        **options: Any,
    ) -> None:
        self.host = host
        self.port = port
        # Bounded so stop() cannot hang on a request stalled by a long timeout fault.
        self.shutdown_timeout = shutdown_timeout
        self.app = app
        #: Extra ``uvicorn.Config`` settings (the receiver's limits: ``serving.uvicorn_options``).
        self.options = options
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._base_url: str | None = None

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise RuntimeError("server is not started")
        return self._base_url

    def start(self, timeout: float = 10.0) -> str:
        """Start serving and return the base URL once the server accepts connections."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        sock = bind(self.host, self.port)
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn_config(self.app, self.shutdown_timeout, **self.options))
        thread = threading.Thread(
            target=server.run,
            kwargs={"sockets": [sock]},
            name=f"asgi-server-{port}",
            daemon=True,
        )
        self._server, self._thread, self._sock = server, thread, sock
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server failed to start on {self.host}:{port}")
            time.sleep(0.005)
        self.port = port
        self._base_url = url_for(self.host, port)
        return self._base_url

    def stop(self) -> None:
        """Stop the server and wait for its thread; safe to call more than once."""
        server, thread, sock = self._server, self._thread, self._sock
        self._server = self._thread = self._sock = None
        self._base_url = None
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(self.shutdown_timeout + 5.0)
            if thread.is_alive() and server is not None:
                server.force_exit = True
                thread.join(5.0)
        if sock is not None:
            sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
