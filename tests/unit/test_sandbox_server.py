"""Contract tests for the sandbox email provider.

The rest of the platform (client retries, idempotency, benchmarks) trusts the sandbox to
behave like a real provider, so these tests pin its HTTP contract over a real loopback
server: acceptance and recording, idempotent replay, every fault-injection path (recipient
directives, programmable rules, seeded random rates), request validation, API-key
enforcement, and that concurrent duplicates still create a single message.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from email_platform.sandbox.server import SandboxConfig, SandboxServer

TIMEOUT_DELAY_S = 0.3


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with SandboxServer(SandboxConfig(timeout_delay_s=TIMEOUT_DELAY_S, retry_after_s=1)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=5.0) as c:
        c.post("/_sandbox/reset").raise_for_status()
        yield c


def payload(to: str = "jane@example.com", event_id: str = "evt_1", **extra: Any) -> dict:
    body = {
        "from": "noreply@shop.test",
        "to": to,
        "subject": "Your order",
        "text": "Thanks!",
        "html": "<p>Thanks!</p>",
        "headers": {"X-Campaign": "orders"},
        "metadata": {"event_id": event_id, "idempotency_key": f"idem-{event_id}"},
        "tags": ["order"],
    }
    body.update(extra)
    return body


def send(
    client: httpx.Client,
    key: str | None,
    body: dict | None = None,
    headers: dict[str, str] | None = None,
    **kw: Any,
) -> httpx.Response:
    all_headers = {"Idempotency-Key": key} if key is not None else {}
    all_headers.update(headers or {})
    return client.post("/v1/send", json=body or payload(), headers=all_headers, **kw)


def stats(client: httpx.Client) -> dict:
    return client.get("/_sandbox/stats").json()


def messages(client: httpx.Client, **params: str) -> list[dict]:
    return client.get("/_sandbox/messages", params=params).json()["messages"]


def test_accept_records_message_and_filters_by_event(client: httpx.Client) -> None:
    first = send(client, "k1", payload(event_id="evt_a"))
    second = send(client, "k2", payload(to="bob@example.com", event_id="evt_b"))

    assert first.status_code == 200 and second.status_code == 200
    body = first.json()
    assert body["id"].startswith("sbx_") and body["id"] != second.json()["id"]
    accepted_at = datetime.fromisoformat(body["accepted_at"])
    assert accepted_at.utcoffset() == timedelta(0)
    assert "idempotent-replayed" not in first.headers

    listed = messages(client)
    assert [m["id"] for m in listed] == [body["id"], second.json()["id"]]
    sent = payload(event_id="evt_a")
    assert listed[0] == {
        "id": body["id"],
        "idempotency_key": "k1",
        "to": sent["to"],
        "from": sent["from"],
        "subject": sent["subject"],
        "text": sent["text"],
        "html": sent["html"],
        "headers": sent["headers"],
        "metadata": sent["metadata"],
        "tags": sent["tags"],
        "accepted_at": body["accepted_at"],
    }
    assert [m["to"] for m in messages(client, event_id="evt_b")] == ["bob@example.com"]
    assert messages(client, event_id="nope") == []
    assert stats(client) == {
        "requests": 2,
        "batch_requests": 0,
        "peak_in_flight": 1,
        "send_attempts": 2,
        "accepted": 2,
        "repeated_keys": 0,
        "faults": dict.fromkeys(
            [
                *("429", "500", "503", "timeout", "accept_timeout", "reset", "accept_reset"),
                *("422", "400", "401"),
            ],
            0,
        ),
    }


def test_reset_clears_everything(client: httpx.Client) -> None:
    send(client, "k1")
    client.post("/_sandbox/faults", json={"rules": [{"kind": "500", "times": 5}]})
    client.post("/_sandbox/reset").raise_for_status()

    assert messages(client) == []
    assert client.get("/_sandbox/faults").json()["rules"] == []
    assert stats(client)["requests"] == 0
    # The idempotency store is gone too, so the old key creates a fresh message.
    assert send(client, "k1").status_code == 200
    assert len(messages(client)) == 1
    assert client.get("/_sandbox/health").json() == {"ok": True}


def test_idempotent_replay_returns_first_answer_and_creates_nothing(client: httpx.Client) -> None:
    first = send(client, "same-key")
    replay = send(client, "same-key", payload(subject="A different subject"))

    assert replay.status_code == 200
    assert replay.content == first.content
    assert replay.headers["idempotent-replayed"] == "true"
    assert [m["subject"] for m in messages(client)] == ["Your order"]
    s = stats(client)
    assert (s["requests"], s["accepted"], s["repeated_keys"]) == (2, 1, 1)


def test_429_directive_then_accept_with_retry_after(client: httpx.Client) -> None:
    body = payload(to="jane+429x2@example.com")
    responses = [send(client, "k429", body) for _ in range(3)]

    assert [r.status_code for r in responses] == [429, 429, 200]
    for r in responses[:2]:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limited"
    # A different key gets its own attempt budget.
    assert send(client, "other-key", body).status_code == 429
    s = stats(client)
    assert s["faults"]["429"] == 3 and s["accepted"] == 1 and s["repeated_keys"] == 0


def test_combined_directives_apply_in_order(client: httpx.Client) -> None:
    body = payload(to="jane+newsletter+429x1+500x1+503x1@example.com")
    responses = [send(client, "combo", body) for _ in range(4)]

    assert [r.status_code for r in responses] == [429, 500, 503, 200]
    assert responses[1].json()["error"]["code"] == "server_error"
    assert responses[2].json()["error"]["code"] == "server_error"
    faults = stats(client)["faults"]
    assert (faults["429"], faults["500"], faults["503"]) == (1, 1, 1)


def test_accept_timeout_records_then_replays_same_id(client: httpx.Client) -> None:
    body = payload(to="jane+accepttimeoutx1@example.com", event_id="evt_at")
    with pytest.raises(httpx.ReadTimeout):
        send(client, "k-at", body, timeout=0.1)

    # The provider already accepted it even though the client gave up.
    recorded = messages(client, event_id="evt_at")
    assert len(recorded) == 1

    retry = send(client, "k-at", body)
    assert retry.status_code == 200
    assert retry.json()["id"] == recorded[0]["id"]
    assert retry.headers["idempotent-replayed"] == "true"
    s = stats(client)
    assert s["accepted"] == 1 and s["faults"]["accept_timeout"] == 1 and s["repeated_keys"] == 1


def test_a_reset_cuts_the_answer_and_records_only_after_acceptance(client: httpx.Client) -> None:
    for key, to, recorded in (
        ("k-rs", "jane+resetx1@x.com", 0),
        ("k-ar", "joe+acceptresetx1@x.com", 1),
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            send(client, key, payload(to=to))
        assert [m["idempotency_key"] for m in messages(client)].count(key) == recorded
        retry = send(client, key, payload(to=to))
        assert retry.status_code == 200
        assert (retry.headers.get("idempotent-replayed") == "true") == bool(recorded)
    s = stats(client)
    assert s["accepted"] == 2 and s["faults"]["reset"] == s["faults"]["accept_reset"] == 1


def test_a_reset_in_a_batch_cuts_the_whole_answer_and_keeps_what_it_accepted(
    client: httpx.Client,
) -> None:
    items = [("r1", payload(to="a@example.com")), ("r2", payload(to="b+resetx1@x.com"))]
    with pytest.raises(httpx.RemoteProtocolError):
        batch(client, items)
    assert [m["idempotency_key"] for m in messages(client)] == ["r1"]
    retry = batch(client, items).json()["results"]
    assert [(r["status"], r["replayed"]) for r in retry] == [(200, True), (200, False)]


def test_timeout_directive_stalls_then_fails_without_recording(client: httpx.Client) -> None:
    body = payload(to="jane+timeoutx1@example.com")
    stalled = send(client, "k-to", body)

    assert stalled.status_code == 503
    assert stalled.elapsed.total_seconds() >= TIMEOUT_DELAY_S * 0.9
    assert messages(client) == []
    assert send(client, "k-to", body).status_code == 200
    s = stats(client)
    assert s["accepted"] == 1 and s["faults"]["timeout"] == 1


@pytest.mark.parametrize(
    ("to", "status", "code", "fault"),
    [
        ("jane+reject@example.com", 422, "invalid_recipient", "422"),
        ("jane+400@example.com", 400, "bad_request", "400"),
        ("jane+401@example.com", 401, "unauthorized", "401"),
    ],
)
def test_permanent_directives_fail_every_time(
    client: httpx.Client, to: str, status: int, code: str, fault: str
) -> None:
    responses = [send(client, "k-perm", payload(to=to)) for _ in range(3)]

    assert [r.status_code for r in responses] == [status] * 3
    assert {r.json()["error"]["code"] for r in responses} == {code}
    s = stats(client)
    assert s["accepted"] == 0 and s["faults"][fault] == 3 and s["repeated_keys"] == 0


def test_fault_rules_match_and_are_consumed(client: httpx.Client) -> None:
    added = client.post(
        "/_sandbox/faults",
        json={
            "rules": [
                {"kind": "503", "times": 2, "event_id": "evt_rule"},
                {"kind": "422", "times": 1, "to": "bob@example.com"},
            ]
        },
    )
    assert added.status_code == 200 and added.json()["added"] == 2

    # Unmatched traffic is untouched.
    assert send(client, "k-free", payload(event_id="evt_other")).status_code == 200
    ruled = [send(client, "k-rule", payload(event_id="evt_rule")) for _ in range(3)]
    assert [r.status_code for r in ruled] == [503, 503, 200]
    bob = [send(client, "k-bob", payload(to="bob@example.com", event_id="x")) for _ in range(2)]
    assert [r.status_code for r in bob] == [422, 200]

    assert client.get("/_sandbox/faults").json()["rules"] == []
    s = stats(client)
    assert s["faults"]["503"] == 2 and s["faults"]["422"] == 1 and s["accepted"] == 3


def test_catch_all_rule_and_invalid_rules(client: httpx.Client) -> None:
    client.post("/_sandbox/faults", json={"rules": [{"kind": "timeout", "times": 1}]})
    assert send(client, "k-any", payload(to="anyone@example.com")).status_code == 503

    bad = client.post("/_sandbox/faults", json={"rules": [{"kind": "418", "times": 1}]})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
    bad_times = client.post("/_sandbox/faults", json={"rules": [{"kind": "500", "times": 0}]})
    assert bad_times.status_code == 422
    assert client.get("/_sandbox/faults").json()["rules"] == []


def test_concurrent_same_key_creates_one_message(base_url: str, client: httpx.Client) -> None:
    threads_n = 20
    barrier = threading.Barrier(threads_n)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    raw = json.dumps(payload()).encode()

    def slow_body() -> Iterator[bytes]:
        # Holding the body back keeps every request in flight past its headers, so all 20
        # are inside the server at the same time rather than being served one by one.
        yield raw[:10]
        time.sleep(0.05)
        yield raw[10:]

    def worker() -> None:
        with httpx.Client(base_url=base_url, timeout=5.0) as own:
            barrier.wait()
            response = own.post(
                "/v1/send",
                content=slow_body(),
                headers={"Idempotency-Key": "race-key", "Content-Type": "application/json"},
            )
        with lock:
            results.append(response)

    threads = [threading.Thread(target=worker) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert [r.status_code for r in results] == [200] * threads_n
    assert len({r.json()["id"] for r in results}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in results) == threads_n - 1
    assert len(messages(client)) == 1
    s = stats(client)
    assert (s["requests"], s["accepted"], s["repeated_keys"]) == (threads_n, 1, threads_n - 1)


def test_request_validation(client: httpx.Client) -> None:
    missing_key = send(client, None)
    assert missing_key.status_code == 400
    assert missing_key.json()["error"]["code"] == "missing_idempotency_key"

    bad_json = client.post("/v1/send", content=b"{not json", headers={"Idempotency-Key": "k-json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"

    cases = [
        (payload(to="not-an-address"), "invalid_recipient"),
        (payload(to=""), "invalid_recipient"),
        ({k: v for k, v in payload().items() if k != "to"}, "invalid_recipient"),
        (payload(subject=""), "invalid_request"),
        ({k: v for k, v in payload().items() if k != "from"}, "invalid_request"),
    ]
    for i, (body, code) in enumerate(cases):
        r = send(client, f"k-invalid-{i}", body)
        assert (r.status_code, r.json()["error"]["code"]) == (422, code), body

    # Rejections are not stored, so a corrected retry with the same key succeeds.
    assert send(client, "k-invalid-0").status_code == 200
    s = stats(client)
    assert s["requests"] == 2 + len(cases) + 1 and s["accepted"] == 1


def test_api_key_enforced_on_send_only() -> None:
    with SandboxServer(SandboxConfig(api_key="sk_test")) as url, httpx.Client(base_url=url) as c:
        assert send(c, "k1").status_code == 401
        wrong = send(c, "k1", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
        assert send(c, "k1", headers={"Authorization": "Bearer sk_test"}).status_code == 200
        assert len(messages(c)) == 1
    # After the context exits the port is closed.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/_sandbox/health", timeout=1.0)


def test_seeded_random_rates_are_reproducible_and_counted() -> None:
    cfg = SandboxConfig(seed=1234, rate_429=0.2, rate_5xx=0.2, rate_4xx=0.1, retry_after_s=0.5)
    with SandboxServer(cfg) as url, httpx.Client(base_url=url) as c:

        def run() -> list[int]:
            c.post("/_sandbox/reset").raise_for_status()
            return [send(c, f"rand-{i}").status_code for i in range(200)]

        first_run = run()
        s = stats(c)
        assert run() == first_run

        counts = Counter(first_run)
        assert counts[429] > 0 and counts[500] + counts[503] > 0 and counts[400] > 0
        assert counts[200] == s["accepted"] == len(messages(c))
        assert s["faults"]["429"] == counts[429]
        assert (s["faults"]["500"], s["faults"]["503"]) == (counts[500], counts[503])
        assert s["faults"]["400"] == counts[400]
        assert 0.3 < (200 - counts[200]) / 200 < 0.7

        # Random faults hit first attempts only: a retry of a faulted key succeeds.
        faulted = first_run.index(429)
        retried = send(c, f"rand-{faulted}")
        assert retried.status_code == 200
        r429 = next(r for r in (send(c, f"fresh-{i}") for i in range(100)) if r.status_code == 429)
        assert r429.headers["retry-after"] == "0.5"


# ---- POST /v1/send/batch ----------------------------------------------------------------------


def batch(client: httpx.Client, items: list[tuple[str, dict]], **kw: Any) -> httpx.Response:
    """One batch call; ``items`` are (idempotency key, body)."""
    body = {"messages": [{**b, "idempotency_key": k} for k, b in items]}
    return client.post("/v1/send/batch", json=body, **kw)


def test_batch_accepts_each_message_in_order_with_its_own_key(client: httpx.Client) -> None:
    items = [(f"bk{i}", payload(to=f"u{i}@example.com", event_id=f"evt_{i}")) for i in range(5)]
    answer = batch(client, items)
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert [r["status"] for r in results] == [200] * 5
    assert [r["replayed"] for r in results] == [False] * 5
    listed = messages(client)
    assert [(m["idempotency_key"], m["to"], m["id"]) for m in listed] == [
        (f"bk{i}", f"u{i}@example.com", results[i]["id"]) for i in range(5)
    ]
    assert listed[2]["metadata"] == {"event_id": "evt_2", "idempotency_key": "idem-evt_2"}
    counts = stats(client)
    assert (counts["requests"], counts["batch_requests"], counts["send_attempts"]) == (1, 1, 5)
    assert counts["accepted"] == 5


def test_batch_honours_keys_across_calls_and_within_one_call(client: httpx.Client) -> None:
    single = send(client, "kA", payload(event_id="evt_a"))
    answer = batch(
        client,
        [
            ("kA", payload(event_id="evt_a")),  # accepted before by a single send
            ("kB", payload(event_id="evt_b")),
            ("kB", payload(event_id="evt_b")),  # the same key twice in one call
        ],
    ).json()["results"]
    assert answer[0] == {**single.json(), "status": 200, "replayed": True}
    assert answer[1]["replayed"] is False
    assert answer[2] == {**answer[1], "replayed": True}
    assert [m["idempotency_key"] for m in messages(client)] == ["kA", "kB"]
    assert stats(client)["repeated_keys"] == 2


def test_batch_faults_are_per_message_and_a_retry_sends_only_what_failed(
    client: httpx.Client,
) -> None:
    items = [
        ("f1", payload(to="ok@example.com")),
        ("f2", payload(to="slow+429x1@example.com")),
        ("f3", payload(to="down+503x1@example.com")),
        ("f4", payload(to="nope+reject@example.com")),
    ]
    first = batch(client, items).json()["results"]
    assert [r["status"] for r in first] == [200, 429, 503, 422]
    assert first[1]["retry_after"] == "1"
    assert first[1]["error"]["code"] == "rate_limited"
    assert first[3]["error"]["code"] == "invalid_recipient"
    second = batch(client, items).json()["results"]
    assert [r["status"] for r in second] == [200, 200, 200, 422]
    assert second[0] == {**first[0], "replayed": True}
    assert [m["idempotency_key"] for m in messages(client)] == ["f1", "f2", "f3"]
    assert stats(client)["faults"]["429"] == 1 and stats(client)["faults"]["422"] == 2


def test_batch_with_an_accept_timeout_stalls_the_whole_answer_and_keeps_what_it_accepted(
    client: httpx.Client,
) -> None:
    items = [("t1", payload(to="a@example.com")), ("t2", payload(to="b+accepttimeoutx1@x.com"))]
    with pytest.raises(httpx.ReadTimeout):
        batch(client, items, timeout=TIMEOUT_DELAY_S / 3)
    # Both were accepted before the answer stalled; the retry creates nothing new.
    assert [m["idempotency_key"] for m in messages(client)] == ["t1", "t2"]
    retry = batch(client, items).json()["results"]
    assert [(r["status"], r["replayed"]) for r in retry] == [(200, True), (200, True)]
    assert len(messages(client)) == 2


def test_batch_timeout_fault_records_nothing_for_that_message(client: httpx.Client) -> None:
    started = time.monotonic()
    answer = batch(
        client, [("w1", payload(to="a@example.com")), ("w2", payload(to="b+timeoutx1@x.com"))]
    ).json()["results"]
    assert time.monotonic() - started >= TIMEOUT_DELAY_S
    assert [r["status"] for r in answer] == [200, 503]
    assert [m["idempotency_key"] for m in messages(client)] == ["w1"]


def test_batch_validation(client: httpx.Client) -> None:
    for body, code in (
        ({"messages": []}, "invalid_request"),
        ({"messages": "x"}, "invalid_request"),
        ([], "invalid_request"),
        (
            {"messages": [{**payload(), "idempotency_key": f"v{i}"} for i in range(501)]},
            "batch_too_large",
        ),
    ):
        answer = client.post("/v1/send/batch", json=body)
        assert answer.status_code == 422 and answer.json()["error"]["code"] == code
    assert client.post("/v1/send/batch", content=b"{no").status_code == 400
    results = client.post(
        "/v1/send/batch",
        json={
            "messages": [
                payload(),  # no key
                {**payload(to="not-an-address"), "idempotency_key": "v-bad"},
                {**payload(), "idempotency_key": "v-good"},
            ]
        },
    ).json()["results"]
    assert [(r["status"], r.get("error", {}).get("code")) for r in results] == [
        (400, "missing_idempotency_key"),
        (422, "invalid_recipient"),
        (200, None),
    ]
    assert [m["idempotency_key"] for m in messages(client)] == ["v-good"]


def test_api_key_enforced_on_batch() -> None:
    with SandboxServer(SandboxConfig(api_key="s3cret")) as url, httpx.Client(base_url=url) as c:
        items = [("a1", payload())]
        assert batch(c, items).status_code == 401
        ok = batch(c, items, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["results"][0]["status"] == 200


def test_the_sandbox_remembers_every_webhook_it_planned_and_what_became_of_it() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from email_platform.sandbox.asgi import BackgroundServer
    from email_platform.sandbox.emitter import WebhookPlan

    seen: Counter = Counter()

    async def receive(request: Request) -> Response:
        event = json.loads(await request.body())
        seen[event["id"]] += 1
        if event["type"] == "email.bounced":
            return Response(status_code=401)  # refused for good
        return Response(status_code=503 if seen[event["id"]] == 1 else 200)  # once, then fine

    secret = "whsec_" + "c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seQ=="
    with BackgroundServer(Starlette(routes=[Route("/hook", receive, methods=["POST"])])) as hook:
        rates = {"bounce_rate": 0, "complaint_rate": 0, "unsubscribe_rate": 0, "open_rate": 0}
        plan = WebhookPlan(f"{hook}/hook", secret, delay_s=0, duplicate_rate=0, **rates)
        with SandboxServer(SandboxConfig(webhooks=plan, seed=1)) as url:
            for to in ("a@example.com", "b+bounce@example.com"):
                body = {"to": to, "from": "x@example.com", "subject": "s", "text": "t"}
                headers = {"Idempotency-Key": to}
                httpx.post(f"{url}/v1/send", json=body, headers=headers).raise_for_status()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                answer = httpx.get(f"{url}/_sandbox/webhooks").json()
                if answer["posting"] == 0:
                    break
                time.sleep(0.05)
            page = httpx.get(f"{url}/_sandbox/webhooks", params={"offset": 1, "limit": 5}).json()
            refused = httpx.get(f"{url}/_sandbox/webhooks", params={"limit": "x"})
    records = {r["event"]["data"]["to"]: r for r in answer["webhooks"]}
    assert answer["total"] == 2 and page["webhooks"] == answer["webhooks"][1:]
    delivered, bounced = records["a@example.com"], records["b+bounce@example.com"]
    assert (delivered["event"]["type"], delivered["delivered"]) == ("email.delivered", True)
    assert (delivered["outcome"], delivered["attempts"], delivered["last_status"]) == (
        "delivered",
        2,
        200,
    )
    assert (bounced["delivered"], bounced["outcome"], bounced["last_status"]) == (
        False,
        "refused",
        401,
    )
    assert bounced["event"]["data"]["metadata"] == {}
    assert refused.status_code == 422


def test_the_sandbox_posts_at_most_max_in_flight_webhooks_at_once() -> None:
    """Every message's events used to be posted at once, and a wait for one of httpx's 100
    connections counted against the 5 s timeout: 400 messages against a busy receiver timed
    out every post (0 delivered, 990 failed attempts in 54 s)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from email_platform.sandbox.asgi import BackgroundServer
    from email_platform.sandbox.emitter import WebhookPlan

    now = {"in_flight": 0, "most": 0, "seen": 0}

    async def receive(request: Request) -> Response:
        now["in_flight"] += 1
        now["most"] = max(now["most"], now["in_flight"])
        await asyncio.sleep(0.02)
        now["in_flight"] -= 1
        now["seen"] += 1
        return Response(status_code=200)

    secret = "whsec_" + "c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seQ=="
    with BackgroundServer(Starlette(routes=[Route("/hook", receive, methods=["POST"])])) as hook:
        plan = WebhookPlan(f"{hook}/hook", secret, delay_s=0, duplicate_rate=0, max_in_flight=4)
        with SandboxServer(SandboxConfig(webhooks=plan, seed=2)) as url:
            mail = {"from": "x@example.com", "subject": "s", "text": "t"}
            messages = [
                {**mail, "to": f"m{n}@example.com", "idempotency_key": f"k{n}"} for n in range(40)
            ]
            httpx.post(f"{url}/v1/send/batch", json={"messages": messages}).raise_for_status()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                answer = httpx.get(f"{url}/_sandbox/webhooks", params={"limit": 0}).json()
                if answer["posting"] == 0:
                    break
                time.sleep(0.05)
            stats = httpx.get(f"{url}/_sandbox/stats").json()
    assert stats["webhooks_delivered"] == stats["webhooks_planned"] == now["seen"] > 40
    assert stats["webhook_failed_attempts"] == 0
    assert now["most"] == 4


@pytest.mark.parametrize("path", ["/v1/send", "/v1/send/batch"])
def test_a_sender_gone_mid_body_is_not_an_error_and_nothing_is_accepted(
    client: httpx.Client, base_url: str, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen in the large fault drain: a step process killed while uploading its batch made
    the sandbox log an ASGI traceback for ``ClientDisconnect``."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(base_url)
    with caplog.at_level("ERROR"), socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            'Idempotency-Key: gone-1\r\nContent-Length: 5000\r\n\r\n{"to": '.encode()
        )
        time.sleep(0.2)
    time.sleep(0.3)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    assert stats(client)["accepted"] == 0
    assert send(client, "after-1").status_code == 200  # still serving
