"""The ceiling: a bare loop with no scheduler at all, against the same database and sandbox.

``python -m bench.ceiling --database-url URL --sandbox-url URL [--batch-size 2000]
[--in-flight 64] [--provider-batch 100] [--client loop|threads]`` loops until stopped: claim a
batch of due outbox events (the same atomic claim as the send op), route and render them with
the demo's routes and templates, send them on keep-alive connections, ``--in-flight`` calls at
once (``--provider-batch`` messages per call, as the real path does; 1 = a call per message)
from tasks on one event loop through the adapter's async path, as the lane workers send
(``--client loop``, the default since 2026-12-04), or from as many threads (``--client
threads``: with hundreds of threads their GIL hand-offs cost more than the sending), then mark
them sent in one
transaction per batch (one ``email_messages`` row each, with its ``sent_at``, and the events
done). ``bench.send`` sets ``--in-flight`` to the calls the Dagster system keeps in flight (bulk
workers x concurrency): against a provider that answers in 100 ms, calls in flight, not CPU, set
the speed, and a ceiling with fewer of them would say nothing. No attempts table,
no dedupe, no suppressions, no retry waits (a call that fails transiently is made again at
once, at most ``CALL_TRIES`` times): it is the upper bound the real path is measured against,
not a sender anyone should run. ``bench.send`` starts it in its own process.
"""

import argparse
import asyncio
import signal
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import Engine, Row, insert, select

from bench.providers import PROVIDERS, open_bench_provider
from email_platform.common.errors import TransientError
from email_platform.common.timeutil import utcnow
from email_platform.db.engine import make_engine
from email_platform.db.schema import email_messages
from email_platform.db.schema import email_outbox as outbox_table
from email_platform.mail.recipients import SqlDirectoryResolver
from email_platform.mail.rendering import PACKAGE_TEMPLATES, TemplateRenderer
from email_platform.mail.routes import RouteTable, demo_routes
from email_platform.providers.async_http import new_event_loop
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.sandbox import SandboxProvider
from email_platform.sending.dispatch import messages_per_call
from email_platform.store import outbox

SENDER = "Bench <no-reply@example.com>"


class Mailer:
    """Route, resolve and render one outbox event into the mail(s) it causes."""

    def __init__(self, engine: Engine) -> None:
        self.routes: RouteTable = demo_routes()
        self.renderer = TemplateRenderer(PACKAGE_TEMPLATES)
        self.resolver = SqlDirectoryResolver(
            engine, table_name="users", key_column="id", email_column="email"
        )

    def emails_for(self, event: Row) -> list[tuple[Any, OutgoingEmail]]:
        version, payload = self.routes.upcast(
            event.event_type, event.event_version, dict(event.payload)
        )
        out = []
        for route in self.routes.for_event(event.event_type, version):
            if route.recipient_lookup_field:
                to = self.resolver.lookup(str(payload[route.recipient_lookup_field]))
            else:
                to = payload[route.recipient_field]
            rendered = self.renderer.render(route.template, None, payload)
            key = f"{event.idempotency_key or event.event_id}:{route.name}"
            out.append(
                (
                    route,
                    OutgoingEmail(
                        message_id=0,
                        event_id=event.event_id,
                        idempotency_key=key,
                        sender=SENDER,
                        to=to,
                        subject=rendered.subject,
                        text=rendered.text,
                        html=rendered.html,
                        template=route.template,
                        lane=event.lane,
                        headers={"X-Email-Event-Id": event.event_id},
                    ),
                )
            )
        return out


def message_row(event: Row, route: Any, email: OutgoingEmail, provider_id: str) -> dict:
    now = utcnow()
    return {
        "event_id": event.event_id,
        "route": route.name,
        "template": route.template,
        "template_version": 1,
        "lane": event.lane,
        "recipient": email.to,
        "recipient_domain": email.to.rsplit("@", 1)[-1],
        "idempotency_key": email.idempotency_key,
        "status": "sent",
        "attempts": 1,
        "provider": "sandbox",
        "provider_message_id": provider_id,
        "created_at": now,
        "updated_at": now,
        "sent_at": now,
    }


#: Tries of a call that fails transiently (a keep-alive connection the sandbox closed just
#: as the request went out): a ceiling that stops at the first one measures nothing.
CALL_TRIES = 3


def _call(provider: SandboxProvider, emails: list[OutgoingEmail]) -> list[Any]:
    for tries_left in range(CALL_TRIES - 1, -1, -1):
        try:
            if len(emails) == 1:
                return [provider.send(emails[0])]
            results = provider.send_many(emails)
        except TransientError:
            if not tries_left:
                raise
            continue
        if tries_left and any(isinstance(r, TransientError) for r in results):
            continue  # the whole call again: the sandbox dedupes on the idempotency key
        return results
    raise AssertionError("unreachable")


async def _call_async(provider: SandboxProvider, emails: list[OutgoingEmail]) -> list[Any]:
    """``_call`` on the running event loop, through the adapter's own async path."""
    for tries_left in range(CALL_TRIES - 1, -1, -1):
        try:
            if len(emails) == 1:
                return [await provider.send_async(emails[0])]
            results = await provider.send_many_async(emails)
        except TransientError:
            if not tries_left:
                raise
            continue
        if tries_left and any(isinstance(r, TransientError) for r in results):
            continue
        return results
    raise AssertionError("unreachable")


def _rows(items: list[tuple], results: list[Any]) -> list[dict]:
    rows = []
    for (event, route, email), accepted in zip(items, results, strict=True):
        if not isinstance(accepted, Accepted):
            raise accepted
        rows.append(message_row(event, route, email, accepted.provider_message_id))
    return rows


async def _send_on_loop(
    provider: SandboxProvider, chunks: list[list[tuple]], in_flight: int
) -> list[dict]:
    """Every chunk's call, ``in_flight`` at a time, from tasks on one event loop."""
    todo = deque(chunks)
    rows: list[dict] = []

    async def sender() -> None:
        while todo:
            items = todo.popleft()
            rows.extend(_rows(items, await _call_async(provider, [e for _, _, e in items])))

    await asyncio.gather(*(sender() for _ in range(min(in_flight, len(chunks)))))
    return rows


def run(
    database_url: str,
    sandbox_url: str,
    batch_size: int,
    in_flight: int,
    provider_batch: int,
    client: str = "loop",
    provider_name: str = "sandbox",
) -> None:
    """Send until SIGTERM, keeping up to ``in_flight`` provider calls going: from tasks on one
    event loop (``client="loop"``, the adapter's async path, as the lane workers send) or from
    as many threads (``"threads"``)."""
    engine = make_engine(database_url)
    mailer = Mailer(engine)
    provider = open_bench_provider(
        provider_name, sandbox_url, batch_max=provider_batch, max_connections=in_flight
    )
    if client not in ("loop", "threads"):
        raise ValueError(f"client {client!r}: say loop or threads")
    if client == "loop" and not provider.async_ready:
        raise SystemExit(
            "the sandbox adapter has no event-loop path here (a proxy in the environment?); "
            "use --client threads"
        )
    loop = new_event_loop()
    try:
        _send_until_stopped(engine, mailer, provider, loop, batch_size, in_flight, client)
    finally:
        provider.close()
        loop.run_until_complete(asyncio.sleep(0))  # let the pool's close run on its loop
        loop.close()


def _send_until_stopped(
    engine: Engine,
    mailer: Mailer,
    provider: SandboxProvider,
    loop: asyncio.AbstractEventLoop,
    batch_size: int,
    in_flight: int,
    client: str,
) -> None:
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    with ThreadPoolExecutor(max_workers=in_flight if client == "threads" else 1) as pool:
        while not stop:
            now = utcnow()
            with engine.begin() as connection:
                ids = (
                    connection.execute(
                        select(outbox_table.c.event_id)
                        .where(outbox_table.c.status == outbox.PENDING)
                        # Critical first, like the lanes do; then oldest first.
                        .order_by((outbox_table.c.lane != "critical"), outbox_table.c.published_at)
                        .limit(batch_size)
                    )
                    .scalars()
                    .all()
                )
                claimed = (
                    outbox.claim(connection, ids, run_id="ceiling", lease_s=600, now=now)
                    if ids
                    else []
                )
            if not claimed:
                time.sleep(0.05)
                continue
            work = [
                (event, route, email)
                for event in claimed
                for route, email in mailer.emails_for(event)
            ]
            # The same split as the real path.
            per_call = messages_per_call(len(work), in_flight, provider.batch_max)
            chunks = [work[i : i + per_call] for i in range(0, len(work), per_call)]
            if client == "loop":
                rows = loop.run_until_complete(_send_on_loop(provider, chunks, in_flight))
            else:

                def send(items: list[tuple]) -> list[dict]:
                    return _rows(items, _call(provider, [email for _, _, email in items]))

                rows = [row for chunk_rows in pool.map(send, chunks) for row in chunk_rows]
            with engine.begin() as connection:
                connection.execute(insert(email_messages), rows)
                outbox.finish(
                    connection,
                    [e.event_id for e in claimed],
                    status=outbox.DONE,
                    resolution="sent",
                    now=utcnow(),
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--sandbox-url", required=True)
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument(
        "--in-flight",
        "--concurrency",
        dest="in_flight",
        type=int,
        default=64,
        help="provider calls in flight",
    )
    parser.add_argument("--provider-batch", type=int, default=100)
    parser.add_argument(
        "--client",
        choices=("loop", "threads"),
        default="loop",
        help="calls in flight from tasks on one event loop (the lane workers' way) or threads",
    )
    parser.add_argument("--provider", choices=PROVIDERS, default="sandbox")
    args = parser.parse_args()
    run(
        args.database_url,
        args.sandbox_url,
        args.batch_size,
        args.in_flight,
        args.provider_batch,
        args.client,
        args.provider,
    )


if __name__ == "__main__":
    main()
