"""The sandbox's webhook side: after accepting a message it posts Standard-Webhooks-signed
delivered / opened / clicked / bounced / complained events to the receiver, at configured
rates, retrying like a real provider until the receiver answers 2xx. It remembers every event
it planned and what became of it (``planned()``, ``GET /_sandbox/webhooks``), so a fault
harness can check each one's fate.

Recipient directives force an outcome: ``+bounce``, ``+softbounce``, ``+complaint``,
``+unsubscribe``, ``+open``, ``+click`` (``+machineopen`` for an Apple-proxy open).
"""

import asyncio
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from email_platform.webhooks.standard import sign

HUMAN_AGENT = (
    "Mozilla/5.0 (Macintosh; Intel Mac OS X 14_5) AppleWebKit/605.1.15 (KHTML, like Gecko)"
)


@dataclass
class WebhookPlan:
    webhook_url: str
    secret: str
    delivered_rate: float = 0.97
    bounce_rate: float = 0.02
    complaint_rate: float = 0.003
    unsubscribe_rate: float = 0.002
    open_rate: float = 0.45
    click_rate: float = 0.3
    machine_open_rate: float = 0.25
    duplicate_rate: float = 0.05
    delay_s: float = 0.05
    max_attempts: int = 8
    #: Posts in flight at once; the rest wait their turn (not counted against the timeout).
    max_in_flight: int = 32
    #: Most planned events remembered (about 1 KiB each); later ones are only counted.
    max_recorded: int = 200_000


def _tags(to: str) -> set[str]:
    local = to.split("@", 1)[0]
    return set(local.split("+")[1:])


def plan_events(plan: WebhookPlan, message: dict[str, Any], rng: random.Random) -> list[dict]:
    """The provider events one accepted message produces, oldest first."""
    tags = _tags(message["to"])
    base = {
        "message_id": message["id"],
        "to": message["to"],
        "metadata": message.get("metadata") or {},
    }
    now = datetime.now(UTC)
    events: list[tuple[str, dict[str, Any]]] = []
    if "bounce" in tags or ("softbounce" not in tags and rng.random() < plan.bounce_rate):
        events.append(
            ("email.bounced", {"bounce": {"type": "hard", "reason": "550 5.1.1 user unknown"}})
        )
    elif "softbounce" in tags:
        events.append(("email.delivery_delayed", {}))
        events.append(("email.bounced", {"bounce": {"type": "soft", "reason": "452 mailbox full"}}))
    elif "complaint" in tags or rng.random() < plan.delivered_rate:
        events.append(("email.delivered", {}))
        machine = "machineopen" in tags or rng.random() < plan.machine_open_rate
        opened = {"open", "click", "machineopen"} & tags or rng.random() < plan.open_rate
        if opened:
            events.append(
                (
                    "email.opened",
                    {
                        "user_agent": "Mozilla/5.0" if machine else HUMAN_AGENT,
                        "ip": "17.58.101.7" if machine else "203.0.113.24",
                    },
                )
            )
            if "click" in tags or (not machine and rng.random() < plan.click_rate):
                events.append(
                    (
                        "email.clicked",
                        {
                            "click": {"url": "https://app.example.com/start"},
                            "user_agent": HUMAN_AGENT,
                            "ip": "203.0.113.24",
                        },
                    )
                )
        if "complaint" in tags or rng.random() < plan.complaint_rate:
            events.append(("email.complained", {}))
        elif "unsubscribe" in tags or rng.random() < plan.unsubscribe_rate:
            events.append(("email.unsubscribed", {}))
    out = []
    for offset, (kind, extra) in enumerate(events):
        out.append(
            {
                "id": "evt_" + os.urandom(10).hex(),
                "type": kind,
                "created_at": (now + timedelta(seconds=offset)).isoformat().replace("+00:00", "Z"),
                "data": {**base, **extra},
            }
        )
    return out


class WebhookEmitter:
    """Posts planned events in the background of the sandbox's event loop."""

    def __init__(self, plan: WebhookPlan, seed: int | None = None) -> None:
        self.plan = plan
        self.rng = random.Random(seed)
        self.client: httpx.AsyncClient | None = None
        self.gate: asyncio.Semaphore | None = None
        self.tasks: set[asyncio.Task] = set()
        self.stats = {
            "webhooks_planned": 0,
            "webhooks_delivered": 0,
            "webhook_failed_attempts": 0,
            "webhooks_duplicated": 0,
            "webhooks_unrecorded": 0,
        }
        #: Event id -> {"event", "attempts", "last_status", "delivered", "outcome"}; the
        #: outcome is None while posting, then "delivered", "refused" (a 4xx) or "exhausted".
        self.records: dict[str, dict[str, Any]] = {}
        # The harness may read from another thread than the sandbox's event loop.
        self._lock = threading.Lock()

    def planned(self, offset: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """Copies of the records, in planning order."""
        with self._lock:
            records = list(self.records.values())
        end = None if limit is None else offset + limit
        return [{**r} for r in records[offset:end]]

    def _record(self, events: list[dict]) -> None:
        with self._lock:
            for event in events:
                if len(self.records) >= self.plan.max_recorded:
                    self.stats["webhooks_unrecorded"] += 1
                    continue
                self.records[event["id"]] = {
                    "event": event,
                    "attempts": 0,
                    "last_status": None,
                    "delivered": False,
                    "outcome": None,
                }

    def _note(self, event_id: str, status: int | None, outcome: str | None) -> None:
        with self._lock:
            record = self.records.get(event_id)
            if record is None:
                return
            record["attempts"] += 1
            record["last_status"] = status
            if outcome == "delivered":
                record["delivered"] = True
            if outcome is not None:  # a duplicate post never undoes a delivery
                record["outcome"] = "delivered" if record["delivered"] else outcome

    def schedule(self, message: dict[str, Any]) -> None:
        events = plan_events(self.plan, message, self.rng)
        self.stats["webhooks_planned"] += len(events)
        self._record(events)
        task = asyncio.get_running_loop().create_task(self._deliver_all(events))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _deliver_all(self, events: list[dict]) -> None:
        await asyncio.sleep(self.plan.delay_s)
        for event in events:
            await self._deliver(event)
            if self.rng.random() < self.plan.duplicate_rate:
                # Providers deliver at least once: the receiver must shrug duplicates off.
                self.stats["webhooks_duplicated"] += 1
                await self._deliver(event)

    async def _deliver(self, event: dict) -> None:
        if self.client is None or self.gate is None:
            self.client = httpx.AsyncClient(timeout=5.0)
            self.gate = asyncio.Semaphore(self.plan.max_in_flight)
        body = json.dumps(event).encode()
        for attempt in range(self.plan.max_attempts):
            last = attempt == self.plan.max_attempts - 1
            try:
                async with self.gate:  # signed once its turn comes, so never stale on arrival
                    timestamp = int(time.time())
                    headers = {
                        "content-type": "application/json",
                        "webhook-id": event["id"],
                        "webhook-timestamp": str(timestamp),
                        "webhook-signature": sign(self.plan.secret, event["id"], timestamp, body),
                    }
                    response = await self.client.post(
                        self.plan.webhook_url, content=body, headers=headers
                    )
            except httpx.HTTPError:
                self._note(event["id"], None, "exhausted" if last else None)
            else:
                status = response.status_code
                if 200 <= status < 300:
                    self.stats["webhooks_delivered"] += 1
                    self._note(event["id"], status, "delivered")
                    return
                if 400 <= status < 500 and status != 429:
                    self.stats["webhook_failed_attempts"] += 1
                    self._note(event["id"], status, "refused")
                    return  # refused for good (bad signature, malformed): no point retrying
                self._note(event["id"], status, "exhausted" if last else None)
            self.stats["webhook_failed_attempts"] += 1
            if not last:
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
