"""Which HTTP client keeps hundreds of provider calls in flight for the least CPU.

``python -m bench.http_clients [--latency-ms 100] [--requests 6000] [--in-flight 256]`` starts
the sandbox provider (``email-platform sandbox serve``) at that latency and sends ``--requests``
single-message calls through each client from this one process, at most ``--in-flight`` at
once, then prints requests per second and this process's CPU per request:

- ``threads``: the ``SandboxProvider`` adapter's blocking path (httpx, one keep-alive client per
  thread), from ``min(in-flight, 64)`` threads (what the dispatcher uses for SMTP and wrapped
  providers);
- ``event-loop``: the same adapter's ``send_async`` on the project's event-loop client
  (``providers/async_http.py``), ``in-flight`` tasks on one loop (what the HTTP adapters use);
- ``httpx-async``: httpx's ``AsyncClient`` with ``in-flight`` connections;
- ``aiohttp``: aiohttp's ``ClientSession`` (only when aiohttp is installed).

Every call carries its own idempotency key and must be accepted (200): a client that drops or
fails calls is reported, not timed as if it had sent them. The figures and the choice they
support are in bench/README.md.
"""

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import httpx
import psutil

from bench.harness import free_port
from email_platform.providers.async_http import new_event_loop
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.sandbox import SandboxProvider

MAX_THREADS = 64


def _email(i: int, prefix: str) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=i,
        event_id=f"01KDVFF0NRVB039663SG{i:06d}",
        idempotency_key=f"{prefix}:{i}",
        sender="Bench <no-reply@example.com>",
        to=f"u{i % 500}@example.com",
        subject="Your digest",
        text="Hello there " * 40,
        html="<p>Hello there</p>" * 40,
        template="weekly_digest",
        lane="bulk",
    )


def _threads(url: str, requests: int, in_flight: int, prefix: str) -> int:
    provider = SandboxProvider(url, batch_max=1, max_connections=in_flight, timeout_s=30)
    try:
        with futures.ThreadPoolExecutor(min(in_flight, MAX_THREADS)) as pool:
            sent = pool.map(lambda i: provider.send(_email(i, prefix)), range(requests))
            return sum(1 for _ in sent)
    finally:
        provider.close()


def _event_loop(url: str, requests: int, in_flight: int, prefix: str) -> int:
    provider = SandboxProvider(url, batch_max=1, max_connections=in_flight, timeout_s=30)
    loop = new_event_loop()

    async def main() -> int:
        todo = iter(range(requests))

        async def sender() -> int:
            return sum([1 for i in todo if await provider.send_async(_email(i, prefix))])

        return sum(await asyncio.gather(*(sender() for _ in range(in_flight))))

    try:
        return loop.run_until_complete(main())
    finally:
        provider.close()
        loop.close()


def _body(i: int, prefix: str) -> tuple[bytes, dict[str, str]]:
    email = _email(i, prefix)
    body = {
        "from": email.sender,
        "to": email.to,
        "subject": email.subject,
        "text": email.text,
        "html": email.html,
        "headers": {},
        "metadata": {"event_id": email.event_id, "idempotency_key": email.idempotency_key},
    }
    headers = {"Idempotency-Key": email.idempotency_key, "Content-Type": "application/json"}
    return json.dumps(body).encode(), headers


def _httpx_async(url: str, requests: int, in_flight: int, prefix: str) -> int:
    async def main() -> int:
        todo = iter(range(requests))
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:

            async def sender() -> int:
                ok = 0
                for i in todo:
                    content, headers = _body(i, prefix)
                    answer = await client.post("/v1/send", content=content, headers=headers)
                    ok += answer.status_code == 200 and bool(answer.json())
                return ok

            return sum(await asyncio.gather(*(sender() for _ in range(in_flight))))

    return new_event_loop().run_until_complete(main())


def _aiohttp(url: str, requests: int, in_flight: int, prefix: str) -> int:
    import aiohttp

    async def main() -> int:
        todo = iter(range(requests))
        connector = aiohttp.TCPConnector(limit=in_flight, limit_per_host=in_flight)
        async with aiohttp.ClientSession(url, connector=connector) as session:

            async def sender() -> int:
                ok = 0
                for i in todo:
                    content, headers = _body(i, prefix)
                    async with session.post("/v1/send", data=content, headers=headers) as answer:
                        raw = await answer.read()
                        ok += answer.status == 200 and bool(json.loads(raw))
                return ok

            return sum(await asyncio.gather(*(sender() for _ in range(in_flight))))

    return new_event_loop().run_until_complete(main())


CLIENTS: dict[str, Callable[[str, int, int, str], int]] = {
    "threads": _threads,
    "event-loop": _event_loop,
    "httpx-async": _httpx_async,
    "aiohttp": _aiohttp,
}


def _installed(name: str) -> bool:
    if name != "aiohttp":
        return True
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return False
    return True


def start_sandbox(port: int, latency_ms: float) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "email-platform"), "sandbox", "serve"]
    sandbox = subprocess.Popen(
        [*command, "--port", str(port), "--latency-ms", str(latency_ms)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/_sandbox/health", timeout=1)
            return sandbox
        except httpx.HTTPError:
            time.sleep(0.1)
    sandbox.terminate()
    raise RuntimeError("the sandbox did not come up")


def measure(url: str, name: str, requests: int, in_flight: int) -> dict[str, float | int | str]:
    """One client's run: requests sent, requests/s, this process's CPU µs per request."""
    me = psutil.Process()
    cpu_before = sum(me.cpu_times()[:2])
    started = time.monotonic()
    sent = CLIENTS[name](url, requests, in_flight, uuid.uuid4().hex[:8])
    wall_s = time.monotonic() - started
    cpu_s = sum(me.cpu_times()[:2]) - cpu_before
    return {
        "client": name,
        "sent": sent,
        "requests_per_s": round(sent / wall_s, 1),
        "cpu_us_per_request": round(cpu_s / max(sent, 1) * 1e6, 1),
        "threads": threading.active_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    port = free_port()
    sandbox = start_sandbox(port, args.latency_ms)
    rows = []
    try:
        for name in args.clients.split(","):
            if not _installed(name):
                print(f"{name:12} not installed, skipped")
                continue
            row = measure(f"http://127.0.0.1:{port}", name, args.requests, args.in_flight)
            rows.append(row)
            print(
                f"{name:12} sent={row['sent']:<6} {row['requests_per_s']:>8}/s "
                f"{row['cpu_us_per_request']:>8} us CPU per request",
                flush=True,
            )
    finally:
        sandbox.terminate()
        sandbox.wait(timeout=30)
    if args.json:
        settings = {k: getattr(args, k) for k in ("latency_ms", "requests", "in_flight")}
        Path(args.json).write_text(json.dumps({"settings": settings, "clients": rows}, indent=2))
    return 0 if all(row["sent"] == args.requests for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
