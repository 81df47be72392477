"""Unit tests of event routing: which mail an event causes and which runs carry it.

Two pure layers: ``email_platform.mail.routes`` (route lookups, upcasting older event versions, lane
choice, application-level dedupe keys) and the planning half of the outbox sensor
(``batch_run_key`` and ``plan_run_requests``: batching, run keys, tags and run config). No
database, no Dagster instance: the sensor helpers are fed plain dataclass rows.
"""

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from email_platform.common.errors import PermanentError, UnknownEventVersionError
from email_platform.common.ids import new_ulid
from email_platform.common.lanes import Lane
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import Route, RouteTable, default_routes
from email_platform.sensors.outbox import batch_run_key, plan_run_requests

V1_SIGNED_UP = {"user_id": "user_abc123", "email": "jane@example.com", "name": "Jane Doe"}


@pytest.fixture
def routes() -> RouteTable:
    return default_routes()


def _route(name: str, lane: Lane, event_type: str = "order.shipped", **kw: Any) -> Route:
    return Route(name=name, event_type=event_type, event_version=1, template=name, lane=lane, **kw)


# --- default routes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event_type", "version", "name", "template", "lane"),
    [
        ("user.signed_up", 2, "welcome", "welcome", Lane.TRANSACTIONAL),
        ("user.password_reset_requested", 1, "password_reset", "password_reset", Lane.CRITICAL),
        ("order.paid", 1, "receipt", "receipt", Lane.TRANSACTIONAL),
        ("digest.ready", 1, "weekly_digest", "weekly_digest", Lane.BULK),
    ],
)
def test_default_routes_lookup(
    routes: RouteTable, event_type: str, version: int, name: str, template: str, lane: Lane
) -> None:
    [route] = routes.for_event(event_type, version)
    assert (route.name, route.template, route.lane) == (name, template, lane)
    assert routes.current_version(event_type) == version
    assert routes.knows(event_type)
    assert routes.lane_for(event_type) is lane


def test_routes_are_keyed_by_version(routes: RouteTable) -> None:
    assert routes.for_event("user.signed_up", 1) == []
    assert routes.for_event("user.signed_up", 3) == []


def test_unrouted_event_type(routes: RouteTable) -> None:
    assert routes.for_event("billing.invoice_voided", 1) == []
    assert routes.current_version("billing.invoice_voided") is None
    assert not routes.knows("billing.invoice_voided")
    assert routes.lane_for("billing.invoice_voided") is None
    assert routes.header_fields_for("billing.invoice_voided") == set()
    assert routes.recipient_fields_for("billing.invoice_voided") == set()


def test_password_reset_route_looks_its_recipient_up(routes: RouteTable) -> None:
    [route] = routes.for_event("user.password_reset_requested", 1)
    assert route.recipient_field is None
    assert route.recipient_lookup_field == "user_id"
    assert route.bypass_unsubscribe is True
    assert route.ttl_s == 15 * 60
    assert routes.recipient_fields_for("user.password_reset_requested") == set()
    assert routes.header_fields_for("user.password_reset_requested") == set()


def test_header_and_recipient_fields(routes: RouteTable) -> None:
    assert routes.header_fields_for("user.signed_up") == {"first_name", "email"}
    assert routes.recipient_fields_for("user.signed_up") == {"email"}
    # The receipt subject reads order_id, so it is a header field too.
    assert routes.header_fields_for("order.paid") == {"first_name", "email", "order_id"}


def test_marketing_mail_does_not_bypass_unsubscribe(routes: RouteTable) -> None:
    bypassing = {r.name for r in routes.routes if r.bypass_unsubscribe}
    assert bypassing == {"password_reset"}


def test_every_shipped_route_has_a_shipped_template(routes: RouteTable) -> None:
    renderer = TemplateRenderer()
    for route in routes.routes:
        assert renderer.latest_version(route.template) >= 1, route.name


# --- upcasting --------------------------------------------------------------------------------


def test_signed_up_v1_is_upcast_to_v2(routes: RouteTable) -> None:
    original = dict(V1_SIGNED_UP)
    version, payload = routes.upcast("user.signed_up", 1, original)
    assert version == 2
    assert payload == {"user_id": "user_abc123", "email": "jane@example.com", "first_name": "Jane"}
    assert original == V1_SIGNED_UP  # the caller's payload is not mutated
    # ... and the upcast payload routes and satisfies the v2 route's dedupe.
    [route] = routes.for_event("user.signed_up", version)
    assert route.dedupe_key_for(payload) == "welcome:user_abc123"


@pytest.mark.parametrize("name", [None, "", "Jane"], ids=["absent", "empty", "single"])
def test_upcast_first_name_fallbacks(routes: RouteTable, name: str | None) -> None:
    payload = {"user_id": "u1", "email": "jane@example.com"}
    if name is not None:
        payload["name"] = name
    _, upcast = routes.upcast("user.signed_up", 1, payload)
    assert upcast["first_name"] == (name or "there")
    assert "name" not in upcast


def test_upcast_keeps_an_existing_first_name(routes: RouteTable) -> None:
    payload = {**V1_SIGNED_UP, "first_name": "Janie"}
    assert routes.upcast("user.signed_up", 1, payload)[1]["first_name"] == "Janie"


def test_current_version_passes_through_unchanged(routes: RouteTable) -> None:
    payload = {"user_id": "u1", "email": "jane@example.com", "first_name": "Jane"}
    assert routes.upcast("user.signed_up", 2, payload) == (2, payload)


def test_unrouted_event_is_not_upcast(routes: RouteTable) -> None:
    payload = {"anything": 1}
    assert routes.upcast("billing.invoice_voided", 7, payload) == (7, payload)


@pytest.mark.parametrize(
    ("event_type", "version", "words"),
    [
        ("user.signed_up", 3, "newer"),
        ("user.signed_up", 99, "newer"),
        ("user.signed_up", 0, "no upcaster"),
        ("user.password_reset_requested", 2, "newer"),
    ],
)
def test_unknown_version_is_a_permanent_error(
    routes: RouteTable, event_type: str, version: int, words: str
) -> None:
    with pytest.raises(UnknownEventVersionError, match=words) as info:
        routes.upcast(event_type, version, {"user_id": "u1"})
    assert isinstance(info.value, PermanentError)
    assert info.value.code == "unknown_event_version"
    assert info.value.reason == "unknown_event_version"


def test_upcasters_chain_in_order() -> None:
    table = RouteTable(
        routes=[Route("r", "thing.happened", 3, "t", Lane.BULK)],
        upcasters={
            ("thing.happened", 1): lambda p: {**p, "trail": [*p.get("trail", []), "1->2"]},
            ("thing.happened", 2): lambda p: {**p, "trail": [*p["trail"], "2->3"]},
        },
    )
    assert table.upcast("thing.happened", 1, {}) == (3, {"trail": ["1->2", "2->3"]})
    assert table.upcast("thing.happened", 2, {"trail": []}) == (3, {"trail": ["2->3"]})


def test_a_gap_in_the_upcaster_chain_is_an_unknown_version() -> None:
    table = RouteTable(
        routes=[Route("r", "thing.happened", 3, "t", Lane.BULK)],
        upcasters={("thing.happened", 2): lambda p: p},
    )
    with pytest.raises(UnknownEventVersionError, match="v1"):
        table.upcast("thing.happened", 1, {})


@pytest.mark.parametrize(("name", "expected"), [(" Jane Doe", "Jane"), ("   ", "there")])
def test_upcast_first_name_ignores_surrounding_whitespace(
    routes: RouteTable, name: str, expected: str
) -> None:
    _, payload = routes.upcast("user.signed_up", 1, {**V1_SIGNED_UP, "name": name})
    assert payload["first_name"] == expected


# --- lanes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lanes", "expected"),
    [
        ([Lane.BULK, Lane.CRITICAL, Lane.TRANSACTIONAL], Lane.CRITICAL),
        ([Lane.TRANSACTIONAL, Lane.CRITICAL], Lane.CRITICAL),
        ([Lane.BULK, Lane.TRANSACTIONAL], Lane.TRANSACTIONAL),
        ([Lane.TRANSACTIONAL, Lane.BULK], Lane.TRANSACTIONAL),
        ([Lane.BULK, Lane.BULK], Lane.BULK),
    ],
)
def test_lane_for_picks_the_most_urgent_lane(lanes: list[Lane], expected: Lane) -> None:
    table = RouteTable(routes=[_route(f"r{i}", lane) for i, lane in enumerate(lanes)])
    assert table.lane_for("order.shipped") is expected
    assert RouteTable(routes=list(reversed(table.routes))).lane_for("order.shipped") is expected


def test_lane_for_ignores_other_event_types() -> None:
    table = RouteTable(
        routes=[_route("a", Lane.CRITICAL, "other.event"), _route("b", Lane.BULK)],
    )
    assert table.lane_for("order.shipped") is Lane.BULK


# --- dedupe keys ------------------------------------------------------------------------------


def test_dedupe_key_for(routes: RouteTable) -> None:
    [welcome] = routes.for_event("user.signed_up", 2)
    assert welcome.dedupe_key_for({"user_id": "u_1", "email": "a@b.co"}) == "welcome:u_1"
    assert welcome.dedupe_key_for({"user_id": "u_2"}) == "welcome:u_2"


def test_dedupe_key_is_namespaced_by_route() -> None:
    a = _route("a", Lane.BULK, dedupe_key="{order_id}-{kind}")
    b = _route("b", Lane.BULK, dedupe_key="{order_id}-{kind}")
    payload = {"order_id": "o1", "kind": "shipped"}
    assert a.dedupe_key_for(payload) == "a:o1-shipped"
    assert b.dedupe_key_for(payload) == "b:o1-shipped"


def test_no_dedupe_pattern_means_no_key(routes: RouteTable) -> None:
    [receipt] = routes.for_event("order.paid", 1)
    assert receipt.dedupe_key_for({"order_id": "o1"}) is None


def test_dedupe_key_missing_field_raises_key_error(routes: RouteTable) -> None:
    [welcome] = routes.for_event("user.signed_up", 2)
    with pytest.raises(KeyError, match="user_id"):
        welcome.dedupe_key_for({"email": "jane@example.com"})


# --- sensor planning: run keys ----------------------------------------------------------------


def test_batch_run_key_single_event_is_the_event_id() -> None:
    assert batch_run_key("critical", ["01A"], 0) == "01A"


def test_batch_run_key_batch() -> None:
    assert batch_run_key("bulk", ["01A", "01B", "01C"], 0) == "bulk:01A:01C"


@pytest.mark.parametrize(
    ("ids", "round_", "expected"),
    [(["01A"], 1, "01A:r1"), (["01A", "01C"], 3, "transactional:01A:01C:r3")],
)
def test_batch_run_key_request_round_suffix(ids: list[str], round_: int, expected: str) -> None:
    assert batch_run_key("transactional", ids, round_) == expected


# --- sensor planning: run requests ------------------------------------------------------------


@dataclass(frozen=True)
class FakeRow:
    event_id: str
    event_type: str = "user.signed_up"
    request_count: int = 0
    # Bait: PII the planner must never copy into tags or run config.
    payload: dict[str, Any] = field(
        default_factory=lambda: {"email": "jane@example.com", "first_name": "Jane"}
    )
    recipient: str = "jane@example.com"


def _ids(n: int) -> list[str]:
    return [new_ulid(1_700_000_000_000 + i) for i in range(n)]


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [str(k), *_strings(v)]]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return [str(value)]


def test_chunking_covers_every_event_exactly_once() -> None:
    ids = _ids(7)
    requests = plan_run_requests("bulk", [FakeRow(i) for i in ids], 3, 0)
    batches = [r.run_config["ops"]["send_email_batch"]["config"]["event_ids"] for r in requests]
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [i for b in batches for i in b] == ids
    assert [r.run_key for r in requests] == [
        f"bulk:{ids[0]}:{ids[2]}",
        f"bulk:{ids[3]}:{ids[5]}",
        ids[6],
    ]


def test_batch_ids_are_sorted_and_tags_match() -> None:
    ids = _ids(4)
    shuffled = [ids[2], ids[0], ids[3], ids[1]]
    [request] = plan_run_requests("transactional", [FakeRow(i) for i in shuffled], 10, 5)
    config = request.run_config["ops"]["send_email_batch"]["config"]
    assert config["event_ids"] == ids
    assert request.run_key == f"transactional:{ids[0]}:{ids[3]}"
    assert request.tags == {
        "email/lane": "transactional",
        "email/event_type": "user.signed_up",
        "email/batch_size": "4",
        "email/first_event_id": ids[0],
        "email/last_event_id": ids[3],
        "dagster/priority": "5",
    }


def test_run_config_carries_only_the_lane_event_ids_and_the_json_console() -> None:
    ids = _ids(2)
    [request] = plan_run_requests("critical", [FakeRow(i) for i in ids], 25, 10)
    assert request.run_config == {
        "ops": {"send_email_batch": {"config": {"lane": "critical", "event_ids": ids}}},
        "loggers": {"console": {"config": {"log_level": "INFO"}}},
    }


def test_mixed_event_types_are_tagged_mixed() -> None:
    ids = _ids(3)
    rows = [FakeRow(ids[0]), FakeRow(ids[1], "order.paid"), FakeRow(ids[2])]
    [mixed] = plan_run_requests("transactional", rows, 10, 5)
    assert mixed.tags["email/event_type"] == "mixed"
    single = plan_run_requests("transactional", rows, 1, 5)
    assert [r.tags["email/event_type"] for r in single] == [
        "user.signed_up",
        "order.paid",
        "user.signed_up",
    ]


@pytest.mark.parametrize("run_priority", [0, 5, 10, -3])
def test_priority_tag(run_priority: int) -> None:
    requests = plan_run_requests("bulk", [FakeRow(i) for i in _ids(5)], 2, run_priority)
    assert {r.tags["dagster/priority"] for r in requests} == {str(run_priority)}


def test_request_round_is_the_highest_request_count_in_the_batch() -> None:
    ids = _ids(3)
    rows = [FakeRow(ids[0], request_count=0), FakeRow(ids[1], request_count=2), FakeRow(ids[2])]
    [request] = plan_run_requests("bulk", rows, 10, 0)
    assert request.run_key == f"bulk:{ids[0]}:{ids[2]}:r2"
    [single] = plan_run_requests("critical", [FakeRow(ids[0], request_count=1)], 25, 10)
    assert single.run_key == f"{ids[0]}:r1"


def test_no_pii_in_tags_or_run_config() -> None:
    rows = [FakeRow(i) for i in _ids(5)]
    requests = plan_run_requests("transactional", rows, 2, 5)
    values = [s for r in requests for s in _strings(r.tags) + _strings(r.run_config)]
    assert values  # there is something to inspect
    assert not [v for v in values if "@" in v or "Jane" in v]


def test_duplicate_keys_are_never_yielded() -> None:
    ids = _ids(3)
    rows = [FakeRow(ids[0]), FakeRow(ids[1]), FakeRow(ids[0]), FakeRow(ids[2]), FakeRow(ids[1])]
    requests = plan_run_requests("critical", rows, 1, 10)
    assert [r.run_key for r in requests] == [ids[0], ids[1], ids[2]]


def test_run_keys_are_unique_over_a_large_shuffled_backlog() -> None:
    ids = _ids(1000)
    rows = [FakeRow(i, request_count=random.Random(i).randint(0, 2)) for i in ids]
    random.Random(7).shuffle(rows)
    requests = plan_run_requests("bulk", rows, 37, 0)
    keys = [r.run_key for r in requests]
    assert len(keys) == len(set(keys)) == -(-1000 // 37)
    planned = [
        i for r in requests for i in r.run_config["ops"]["send_email_batch"]["config"]["event_ids"]
    ]
    assert sorted(planned) == ids


def test_no_rows_no_requests() -> None:
    assert plan_run_requests("bulk", [], 500, 0) == []
