"""The sandbox's memory: what it accepted under which key, the faults it chose, its counters."""

import json
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from email_platform.sandbox.emitter import WebhookEmitter, WebhookPlan
from email_platform.sandbox.faults import FAULT_KINDS, FaultRule, directive_for_attempt

#: What a message may carry besides its one recipient (``providers/wire.py``).
ADDRESSING_FIELDS = ("reply_to", "cc", "bcc", "envelope_sender", "attachments")


@dataclass
class SandboxConfig:
    """Behaviour of one sandbox provider instance."""

    api_key: str | None = None
    latency_ms: float = 0
    rate_429: float = 0
    rate_5xx: float = 0
    rate_timeout: float = 0
    rate_accept_timeout: float = 0
    rate_4xx: float = 0
    #: The connection cut mid-answer, before (``reset``) or after the message was accepted.
    rate_reset: float = 0
    rate_accept_reset: float = 0
    retry_after_s: float = 1
    timeout_delay_s: float = 30
    seed: int | None = None
    #: False: behave as a provider without idempotency keys (Postmark, SendGrid, Mailgun,
    #: SES): every request is a new message, however often its key was seen.
    idempotency: bool = True
    #: How 429 answers write Retry-After: seconds, http-date, garbage, or mixed (any of them).
    retry_after_style: str = "seconds"
    #: Where to post signed webhooks for accepted messages (None: no webhooks).
    webhooks: WebhookPlan | None = None
    #: The folder of provider templates it renders (None: the shipped ones, sandbox/templates.py).
    provider_templates: str | None = None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class SandboxState:
    """All mutable state of one app.

    Every read-modify-write happens under ``lock`` and never spans an ``await``: inside one
    event loop that alone makes each decision atomic, and the threading lock (uncontended, so
    nearly free) keeps it correct if the app is ever driven from several threads/loops.
    """

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.emitter = WebhookEmitter(config.webhooks, config.seed) if config.webhooks else None
        self.reset()

    def reset(self) -> None:
        with self.lock:
            # Reseeding keeps a reset server reproducible, like a freshly started one.
            self.rng = random.Random(self.config.seed)
            self.messages: list[dict[str, Any]] = []
            self.answers: dict[str, tuple[int, bytes]] = {}
            self.attempts: dict[str, int] = {}
            self.rules: list[FaultRule] = []
            self.requests = 0
            self.batch_requests = 0
            #: When each send request arrived (epoch seconds, the latest 200,000): what a test
            #: counts a client's request rate over any window with.
            self.request_times: deque[float] = deque(maxlen=200_000)
            #: Send requests inside their latency wait now, and the most there were at once:
            #: how many calls a client really kept in flight.
            self.in_flight = 0
            self.peak_in_flight = 0
            #: Messages offered for sending, alone or in a batch, replays of a key included.
            self.send_attempts = 0
            self.repeated_keys = 0
            self.faults = dict.fromkeys(FAULT_KINDS, 0)

    def arrived(self, *, batch: bool) -> None:
        """Count a send request; caller holds ``lock``."""
        self.requests += 1
        self.batch_requests += batch
        self.request_times.append(time.time())

    def pick_random_fault(self) -> str | None:
        cfg = self.config
        total = (
            cfg.rate_429 + cfg.rate_5xx + cfg.rate_timeout + cfg.rate_accept_timeout + cfg.rate_4xx
        ) + (cfg.rate_reset + cfg.rate_accept_reset)
        if total <= 0:
            return None
        # One draw per request keeps the fault sequence a pure function of the seed.
        u = self.rng.random()
        edge = cfg.rate_429
        if u < edge:
            return "429"
        if u < edge + cfg.rate_5xx:
            return "500" if u < edge + cfg.rate_5xx / 2 else "503"
        edge += cfg.rate_5xx
        if u < edge + cfg.rate_timeout:
            return "timeout"
        edge += cfg.rate_timeout
        if u < edge + cfg.rate_accept_timeout:
            return "accept_timeout"
        edge += cfg.rate_accept_timeout
        if u < edge + cfg.rate_4xx:
            return "400"
        edge += cfg.rate_4xx
        if u < edge + cfg.rate_reset:
            return "reset"
        edge += cfg.rate_reset
        if u < edge + cfg.rate_accept_reset:
            return "accept_reset"
        return None

    def pick_fault(self, key: str, to: str, event_id: str | None) -> str | None:
        """Decide this attempt's fault; caller holds ``lock``."""
        attempt = self.attempts.get(key, 0)
        self.attempts[key] = attempt + 1
        kind = directive_for_attempt(to, attempt)
        if kind is not None:
            return kind
        for index, rule in enumerate(self.rules):
            if rule.matches(to, event_id):
                rule.times -= 1
                if rule.times <= 0:
                    del self.rules[index]
                return rule.kind
        if attempt == 0:
            return self.pick_random_fault()
        return None

    def decide(
        self, key: str, payload: dict[str, Any]
    ) -> tuple[tuple[int, bytes] | None, str | None, dict[str, Any] | None]:
        """One attempt of one valid message: (stored answer of a repeated key, fault, answer of
        a new acceptance). Takes ``lock``; a message is accepted at most once per key."""
        event_id = (payload.get("metadata") or {}).get("event_id")
        with self.lock:
            self.send_attempts += 1
            stored = self.answers.get(key) if self.config.idempotency else None
            if stored is not None:
                self.repeated_keys += 1
                return stored, None, None
            fault = self.pick_fault(key, payload["to"], event_id)
            if fault is not None:
                self.faults[fault] += 1
            accepted = fault in (None, "accept_timeout", "accept_reset")
            answer = self.accept(key, payload) if accepted else None
            return None, fault, answer

    def accept(self, key: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Record the message and store its replayable answer; caller holds ``lock``."""
        accepted_at = datetime.now(UTC).isoformat()
        message_id = "sbx_" + os.urandom(12).hex()
        self.messages.append(
            {
                "id": message_id,
                "idempotency_key": key,
                "to": payload["to"],
                "from": payload["from"],
                "subject": payload["subject"],
                "text": payload.get("text") or "",
                "html": payload.get("html"),
                "headers": payload.get("headers") or {},
                "metadata": payload.get("metadata") or {},
                "tags": payload.get("tags") or [],
                "accepted_at": accepted_at,
                # Reply-To, Cc, Bcc, envelope sender, attachments: as sent, for tests to read.
                **{name: payload[name] for name in ADDRESSING_FIELDS if name in payload},
            }
        )
        answer = {"id": message_id, "accepted_at": accepted_at}
        self.answers[key] = (200, dumps(answer))
        self.attempts.pop(key, None)
        if self.emitter is not None:
            self.emitter.schedule(self.messages[-1])
        return answer

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "batch_requests": self.batch_requests,
                "peak_in_flight": self.peak_in_flight,
                "send_attempts": self.send_attempts,
                "accepted": len(self.messages),
                "repeated_keys": self.repeated_keys,
                "faults": dict(self.faults),
                **(self.emitter.stats if self.emitter else {}),
            }
