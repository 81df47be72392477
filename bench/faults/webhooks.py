"""The chaos harness's webhook scenario: hostile and awkward traffic to the receiver, then every
planned event's fate read back from the database.

``planned`` is what the sandbox remembers posting (``fetch_planned``, ``GET /_sandbox/webhooks``):
records ``{"event": {...}, "delivered": bool, "outcome": ...}`` or bare event dicts
``{"id", "type", "created_at", "data": {"message_id", "to", "metadata": {"event_id",
"idempotency_key"}, ...}}``. Every body that must never be stored carries an event id starting
with ``MARK``, so ``check`` can name it if it was.

The receiver killed between storing and answering is the harness's to do; ``inject``'s
``abandoned`` kind is the same seen from the sender: it hangs up before the answer and retries.
"""

import asyncio
import copy
import json
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import Engine, select

from email_platform.db.schema import email_events, email_messages, suppressions, webhook_inbox
from email_platform.store import inbox
from email_platform.store.suppressions import STRENGTH, normalize
from email_platform.webhooks.sandbox import EVENT_MAP
from email_platform.webhooks.standard import TOLERANCE_S, sign
from email_platform.webhooks.vocabulary import SUPPRESSING, combine

MARK = "evt_faults_"
#: What ``inject`` posts, by kind, and the counts that are 0 when the receiver behaves.
HOSTILE_KINDS = (
    *("reordered", "duplicate", "redelivered", "abandoned", "forged", "stale"),
    *("oversized", "replayed", "flood", "flood_good"),
)
ALARMS = ("hostile_5xx", "hostile_accepted", "authentic_unacknowledged")
WRONG_SECRET = "whsec_" + "bm90LXRoZS1yZWNlaXZlcnMta2V5"  # base64("not-the-receivers-key")


def _event(item: dict[str, Any]) -> dict[str, Any]:
    return item.get("event", item)


def fetch_planned(sandbox_url: str, page: int = 5000) -> list[dict[str, Any]]:
    """Every webhook record the sandbox planned so far, oldest first."""
    records: list[dict[str, Any]] = []
    with httpx.Client(timeout=30) as client:
        while True:
            answer = client.get(
                f"{sandbox_url}/_sandbox/webhooks", params={"offset": len(records), "limit": page}
            ).json()
            records.extend(answer["webhooks"])
            if len(answer["webhooks"]) < page:
                return records


def wait_posted(sandbox_url: str, timeout_s: float = 120) -> list[dict[str, Any]]:
    """The records once the sandbox has stopped posting (each delivered or given up), or as
    they are at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        posting = httpx.get(f"{sandbox_url}/_sandbox/webhooks", params={"limit": 0}).json()
        records = fetch_planned(sandbox_url)
        done = all(r["outcome"] is not None for r in records)
        if (done and posting["posting"] == 0) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wait_settled(engine: Engine, timeout_s: float = 300, poll_s: float = 0.5) -> bool:
    """Whether the inbox emptied (no pending or in-flight webhook) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with engine.connect() as connection:
            counts = inbox.counts_by_status(connection)
        if not counts.get(inbox.PENDING) and not counts.get(inbox.IN_FLIGHT):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


# --- inject ------------------------------------------------------------------------------------


class _Poster:
    def __init__(self, client: httpx.AsyncClient, url: str, secret: str, concurrency: int):
        self.client, self.url, self.secret = client, url, secret
        self.concurrency = concurrency
        self.gate = asyncio.Semaphore(concurrency)  # shared: the good posts queue with the flood
        self.counts: Counter = Counter()

    def headers(
        self, webhook_id: str, body: bytes, *, secret: str | None = None, at: int | None = None
    ) -> dict[str, str]:
        stamp = int(time.time()) if at is None else at
        return {
            "content-type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(stamp),
            "webhook-signature": sign(secret or self.secret, webhook_id, stamp, body),
        }

    async def authentic(self, kind: str, event: dict, webhook_id: str | None = None) -> bool:
        """Post like a provider: fresh signature each attempt, retried until a 2xx."""
        body = json.dumps(event).encode()
        self.counts[kind] += 1
        for attempt in range(8):
            status = await self._send(body, self.headers(webhook_id or event["id"], body))
            self.counts[f"{kind}:{status}"] += 1
            if isinstance(status, int) and 200 <= status < 300:
                return True
            if isinstance(status, int) and 400 <= status < 500 and status != 429:
                break
            await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
        self.counts["authentic_unacknowledged"] += 1
        return False

    async def hostile(
        self, kind: str, content: Any, headers: dict[str, str], *, seen: bool = False
    ) -> None:
        """One post that must be refused; ``seen``: its delivery id is stored, so a 2xx
        (duplicate) is the right answer and nothing may be stored."""
        self.counts[kind] += 1
        status = await self._send(content, headers)
        self.counts[f"{kind}:{status}"] += 1
        if isinstance(status, int) and status >= 500:
            self.counts["hostile_5xx"] += 1
        if not seen and isinstance(status, int) and status < 300:
            self.counts["hostile_accepted"] += 1

    async def abandoned(self, event: dict) -> None:
        """Hang up before the answer (as if the receiver died after storing), then retry."""
        body = json.dumps(event).encode()
        self.counts["abandoned"] += 1
        timeout = httpx.Timeout(5.0, read=0.0005)
        status = await self._send(body, self.headers(event["id"], body), timeout=timeout)
        self.counts[f"abandoned:{status}"] += 1
        await self.authentic("abandoned_retry", event)

    async def _send(self, content: Any, headers: dict[str, str], **kwargs: Any) -> int | str:
        async with self.gate:
            try:
                response = await self.client.post(
                    self.url, content=content, headers=headers, **kwargs
                )
            except httpx.HTTPError as exc:
                return type(exc).__name__
            return response.status_code


def _variant(event: dict, rng: random.Random, tag: str) -> dict:
    """A harmful body about the same message under a marked id: applied, it would show."""
    changed = copy.deepcopy(event)
    changed["id"] = f"{MARK}{tag}_{os.urandom(6).hex()}"
    changed["type"] = rng.choice(["email.complained", "email.bounced"])
    changed["data"]["bounce"] = {"type": "hard", "reason": "550 forged"}
    return changed


def _mangled(signature: str, rng: random.Random) -> str:
    version, _, value = signature.partition(",")
    i = rng.randrange(len(value))
    flipped = value[:i] + ("A" if value[i] != "A" else "B") + value[i + 1 :]
    return rng.choice([f"{version},{flipped}", f"v2,{value}", f"{version},", "v1", flipped])


async def _chunks(body: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def _inject(poster: _Poster, planned: list[dict], rng: random.Random, **opts: Any) -> None:
    size, flood, flood_s, max_body = opts["size"], opts["flood"], opts["flood_s"], opts["max_body"]
    events = [_event(item) for item in planned]
    by_message: dict[str, list[dict]] = defaultdict(list)
    for event in events:
        by_message[event["data"]["message_id"]].append(event)

    def pick(n: int) -> list[dict]:
        return rng.sample(events, min(n, len(events)))

    async def reordered(group: list[dict]) -> None:
        order = group[::-1] if rng.random() < 0.5 else rng.sample(group, len(group))
        if order == group:
            order = group[::-1]
        for event in order:  # one after the other: the order is the point
            await poster.authentic("reordered", event)

    async def replayed(event: dict) -> None:
        if await poster.authentic("replay_original", event):
            body = json.dumps(_variant(event, rng, "replay")).encode()
            await poster.hostile("replayed", body, poster.headers(event["id"], body), seen=True)

    def forged(event: dict, kind: str = "forged") -> Any:
        body = json.dumps(_variant(event, rng, "forged")).encode()
        headers = poster.headers(event["id"], body)
        mode = rng.randrange(4)
        if mode == 0:
            headers = poster.headers(event["id"], body, secret=WRONG_SECRET)
        elif mode == 1:
            headers["webhook-signature"] = _mangled(headers["webhook-signature"], rng)
        elif mode == 2:
            headers["webhook-signature"] = poster.headers(event["id"], b"{}")["webhook-signature"]
        else:
            del headers[rng.choice(["webhook-id", "webhook-timestamp", "webhook-signature"])]
        return poster.hostile(kind, body, headers)

    def stale(event: dict) -> Any:
        body = json.dumps(_variant(event, rng, "stale")).encode()
        now = int(time.time())
        at = rng.choice([now - TOLERANCE_S - 30, now + TOLERANCE_S + 30, 0, now - 86400 * 365])
        return poster.hostile("stale", body, poster.headers(event["id"], body, at=at))

    def oversized(event: dict, n: int) -> Any:
        big = _variant(event, rng, "big")
        big["data"]["padding"] = "x" * (max_body + 1 - len(json.dumps(big)))
        body = json.dumps(big).encode()
        headers = poster.headers(big["id"], body)
        return poster.hostile("oversized", body if n % 2 else _chunks(body), headers)

    groups = [g for g in by_message.values() if len(g) > 1]
    # Reorders first: while the sandbox still waits to post, they really arrive out of order.
    await asyncio.gather(*(reordered(g) for g in rng.sample(groups, min(size, len(groups)))))
    await asyncio.gather(*(poster.authentic("duplicate", e) for e in pick(size) for _ in (1, 2)))
    # The same event under a new delivery id: stored twice, applied once.
    fresh = [(e, f"msg_faults_{os.urandom(6).hex()}") for e in pick(size)]
    await asyncio.gather(*(poster.authentic("redelivered", e, i) for e, i in fresh))
    await asyncio.gather(*(poster.abandoned(e) for e in pick(size)))
    await asyncio.gather(*(forged(e) for e in pick(size)), *(stale(e) for e in pick(size)))
    await asyncio.gather(*(replayed(e) for e in pick(size)))
    await asyncio.gather(*(oversized(e, n) for n, e in enumerate(pick(max(1, size // 2)))))
    if events and flood:
        await _flood(poster, events, rng, flood, flood_s, forged, size)


async def _flood(
    poster: _Poster,
    events: list[dict],
    rng: random.Random,
    count: int,
    limit_s: float,
    forged: Callable[[dict, str], Any],
    size: int,
) -> None:
    """Up to ``count`` requests from one client, none started after ``limit_s``, while good
    webhooks keep arriving: the same authentic event over and over, and forged ones."""
    target = rng.choice(events)
    body = json.dumps(target).encode()
    deadline = time.monotonic() + limit_s
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < count and time.monotonic() < deadline:
            sent += 1
            if sent % 2:
                headers = poster.headers(target["id"], body)
                await poster.hostile("flood", body, headers, seen=True)
            else:
                await forged(rng.choice(events), "flood")

    good = [poster.authentic("flood_good", e) for e in rng.sample(events, min(size, len(events)))]
    await asyncio.gather(*(worker() for _ in range(poster.concurrency)), *good)
    poster.counts["flood_not_sent"] += count - sent


def inject(
    receiver_url: str,
    secret: str,
    planned: list[dict],
    rng: random.Random,
    *,
    size: int,
    flood: int | None = None,
    flood_s: float = 20.0,
    concurrency: int = 32,
    max_body_bytes: int = 1024 * 1024,
) -> Counter:
    """Post duplicates, reorders, forged, stale, replayed, oversized bodies and a flood to
    ``POST {receiver_url}/webhooks/sandbox`` (``size`` of each kind; ``flood`` requests,
    default ``20 * size`` up to 1000). Blocks; call it outside an event loop.

    Counts: requests by kind, ``"<kind>:<status>"`` (or the transport error's name), and
    ``hostile_5xx``, ``hostile_accepted`` (a 2xx to a forged/stale/oversized body) and
    ``authentic_unacknowledged`` (an authentic post that never got a 2xx), all 0 when well.
    """
    flood = min(20 * size, 1000) if flood is None else flood
    url = f"{receiver_url.rstrip('/')}/webhooks/sandbox"

    async def main() -> Counter:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            poster = _Poster(client, url, secret, concurrency)
            options = {"size": size, "flood": flood, "flood_s": flood_s, "max_body": max_body_bytes}
            await _inject(poster, planned, rng, **options)
        for key in ("hostile_5xx", "hostile_accepted", "authentic_unacknowledged"):
            poster.counts[key] += 0
        return poster.counts

    return asyncio.run(main())


# --- check -------------------------------------------------------------------------------------

MAX_DETAILS = 100


@dataclass
class WebhookVerdict:
    """Every planned event's fate; ``counts`` has each finding by kind and what was read."""

    lost: int = 0
    doubled: int = 0
    wrong: int = 0
    details: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.wrong)

    def add(self, fate: str, kind: str, detail: str) -> None:
        setattr(self, fate, getattr(self, fate) + 1)
        self.counts[f"{fate}:{kind}"] += 1
        if len(self.details) < MAX_DETAILS:
            self.details.append(f"{fate} ({kind}): {detail}")


def _in_chunks(connection: Any, query: Any, column: Any, values: set) -> list[Any]:
    ordered, rows = sorted(values), []
    for start in range(0, len(ordered), 500):
        rows.extend(connection.execute(query.where(column.in_(ordered[start : start + 500]))))
    return rows


def _reason(event: dict) -> str | None:
    kind = EVENT_MAP.get(event["type"], "unknown")
    if kind == "bounced":
        hard = (event["data"].get("bounce") or {}).get("type") == "hard"
        return "hard_bounce" if hard else None
    return SUPPRESSING.get(kind)


def _same(event: dict) -> str:
    """An event's content without its id: a copy re-applied under another id matches."""
    return json.dumps([event.get("type"), event.get("data")], sort_keys=True, default=str)


def _message_key(event: dict) -> str:
    metadata = event["data"].get("metadata") or {}
    return metadata.get("idempotency_key") or f"pm:{event['data']['message_id']}"


def check(engine: Engine, planned: list[dict]) -> WebhookVerdict:
    """Compare the database with the planned (authentic) events, after ingestion settled."""
    verdict = WebhookVerdict()
    records = {_event(item)["id"]: item for item in planned}
    events = {i: _event(item) for i, item in records.items()}
    keys = {_message_key(e) for e in events.values()}
    with engine.connect() as connection:
        rows = connection.execute(
            select(
                email_events.c.provider_event_id,
                email_events.c.event_type,
                email_events.c.message_id,
                email_events.c.raw,
            ).where(email_events.c.provider == "sandbox")
        ).all()
        stored = connection.execute(
            select(webhook_inbox.c.status, webhook_inbox.c.body, webhook_inbox.c.error).where(
                webhook_inbox.c.provider == "sandbox"
            )
        ).all()
        query = select(
            email_messages.c.message_id,
            email_messages.c.idempotency_key,
            email_messages.c.provider_message_id,
            email_messages.c.delivery_status,
        )
        found = _in_chunks(connection, query, email_messages.c.idempotency_key, keys)
        by_provider = {k[3:] for k in keys if k.startswith("pm:")}
        found += _in_chunks(connection, query, email_messages.c.provider_message_id, by_provider)
        suppressed = connection.execute(select(suppressions)).all()
    counts = verdict.counts
    counts.update(planned=len(events), email_events=len(rows), inbox_rows=len(stored))
    messages = {m.idempotency_key: m for m in found}
    messages.update({f"pm:{m.provider_message_id}": m for m in found})

    inbox_statuses: dict[str, list[str]] = defaultdict(list)
    for row in stored:
        counts[f"inbox:{row.status}"] += 1
        try:
            body_id = str(json.loads(row.body)["id"])
        except (ValueError, KeyError, TypeError):
            body_id = None
        if body_id in events:
            inbox_statuses[body_id].append(
                f"{row.status} ({row.error})" if row.error else row.status
            )
        else:
            kind = (
                body_id[len(MARK) :].split("_")[0] if body_id and body_id.startswith(MARK) else "?"
            )
            verdict.add("wrong", f"stored_{kind}", f"inbox holds a body not planned: {body_id}")

    applied: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        applied[row.provider_event_id].append(row)
    contents = {_same(e): i for i, e in events.items()}
    for provider_event_id, copies in applied.items():
        if provider_event_id in events:
            continue
        raw = copies[0].raw if isinstance(copies[0].raw, dict) else {}
        twin = contents.get(_same(raw))
        if twin is not None:
            verdict.add("doubled", "reapplied", f"{twin} applied again as {provider_event_id}")
        else:
            verdict.add("wrong", "unplanned_applied", f"event {provider_event_id} applied")

    for event_id, event in events.items():
        copies, message = applied.get(event_id, []), messages.get(_message_key(event))
        what = f"{event_id} ({event['type']} of {event['data']['message_id']})"
        if not copies:
            record = records[event_id]
            if inbox_statuses.get(event_id):
                kind, why = "not_applied", f"stored as {', '.join(inbox_statuses[event_id])}"
            elif "delivered" in record and not record["delivered"]:
                kind, why = "unacknowledged", f"never got a 2xx (outcome {record.get('outcome')})"
            else:
                kind, why = "not_stored", "acknowledged, not in the inbox"
            verdict.add("lost", kind, f"{what}: {why}")
            continue
        if len(copies) > 1:
            verdict.add("doubled", "email_events", f"{what}: {len(copies)} rows")
        row = copies[0]
        if row.event_type != EVENT_MAP.get(event["type"], "unknown"):
            verdict.add("wrong", "event_type", f"{what} stored as {row.event_type}")
        if message is not None and row.message_id != message.message_id:
            verdict.add("wrong", "link", f"{what} linked to message {row.message_id}")

    expected: dict[str, str | None] = {}
    for event in events.values():
        key = _message_key(event)
        expected[key] = combine(expected.get(key), EVENT_MAP.get(event["type"], "unknown"))
    counts["messages"] = len(expected)
    for key, status in expected.items():
        message = messages.get(key)
        if message is None:
            verdict.add("wrong", "no_message", f"no email_messages row for {key}")
        elif message.delivery_status != status:
            verdict.add(
                "wrong",
                "delivery_status",
                f"message {message.message_id}: {message.delivery_status}, events give {status}",
            )
    _check_suppressions(verdict, events.values(), suppressed)
    return verdict


def _check_suppressions(verdict: WebhookVerdict, events: Any, suppressed: list[Any]) -> None:
    wanted: dict[str, str] = {}
    for event in events:
        reason = _reason(event)
        address = normalize(event["data"]["to"])
        if reason and STRENGTH[reason] > STRENGTH.get(wanted.get(address, ""), 0):
            wanted[address] = reason
    verdict.counts["suppressions_expected"] = len(wanted)
    rows = {row.address: row for row in suppressed}
    for address, reason in wanted.items():
        if address not in rows:
            verdict.add("wrong", "suppression_missing", f"{address} ({reason}) not suppressed")
    for address, row in rows.items():
        if row.source != "webhook:sandbox":
            continue  # the harness's own (source="faults"), or another provider's
        if address not in wanted:
            verdict.add("wrong", "suppression_unfounded", f"{address} suppressed ({row.reason})")
        elif row.reason != wanted[address]:
            verdict.add(
                "wrong",
                "suppression_reason",
                f"{address}: {row.reason}, events give {wanted[address]}",
            )
