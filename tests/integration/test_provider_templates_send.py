"""Provider-hosted templates through the real send path (publish -> send job -> sandbox over
HTTP), on SQLite and PostgreSQL: the sandbox renders the template it knows, the message records
the template and version, the warehouse funnel and ``trace`` show them as they show a local
template's, and a template the provider does not know is dead-lettered alone, naming it. Through
SMTP (a real Postfix), which has no templates, the route's local fallback is rendered.
"""

import dataclasses
import json
import shutil
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from email_platform import publish
from email_platform.cli.app import main
from email_platform.common.lanes import Lane
from email_platform.mail.provider_templates import LIVE_VERSION, ProviderTemplate
from email_platform.mail.routes import Route, RouteTable, demo_routes
from email_platform.resources import EmailProviderResource, RoutingResource
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sandbox.templates import SHIPPED
from email_platform.warehouse import refresh
from tests.servers.postfix import Postfix, start_postfix
from tests.support import dead_letters_of, event, messages_of, run_send, sandbox_messages

HERE = "tests.integration.test_provider_templates_send"


def shipped(order: str, **changes: object) -> dict:
    return {
        "order_id": order,
        "email": f"{order.lower()}@example.com",
        "first_name": "Jane",
        "carrier": "DHL",
        "tracking_url": f"https://track.example.com/{order}",
        **changes,
    }


def _publish(engine, payload: dict, routes: RouteTable | None = None, event_type="order.shipped"):  # type: ignore[no-untyped-def]
    with engine.begin() as connection:
        return publish(
            connection,
            event_type=event_type,
            aggregate_id=str(payload.get("order_id", "a1")),
            payload=payload,
            **({"routes": routes} if routes is not None else {}),
        )


def pinned_routes() -> RouteTable:
    """The demo's table with two more provider-template routes: version 1 pinned, and a
    template the sandbox does not have."""
    table = demo_routes()
    shipping = table.route("shipping_notice")
    assert shipping.provider_template is not None
    extra = [
        Route(
            name="shipping_v1",
            event_type="order.shipped_v1",
            event_version=1,
            template="",
            lane=Lane.TRANSACTIONAL,
            provider_template=dataclasses.replace(shipping.provider_template, version="v1"),
        ),
        Route(
            name="lost_template",
            event_type="order.lost",
            event_version=1,
            template="lost_notice",
            lane=Lane.TRANSACTIONAL,
            provider_template=ProviderTemplate("no-such-template", variables=("first_name",)),
        ),
    ]
    return dataclasses.replace(table, routes=[*table.routes, *extra], schemas={})


def test_the_demo_route_is_rendered_by_the_provider_and_recorded_as_its_template(
    engine, database_url, sandbox, tmp_path
):
    event_id = _publish(engine, shipped("O-7"))
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    (message,) = messages_of(engine, event_id)
    assert message.status == "sent" and message.attempts == 1
    assert (message.route, message.template) == ("shipping_notice", "shipping-notice")
    assert message.template_version == LIVE_VERSION  # the provider's live version: 0
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    # The sandbox rendered its live (newest) version, v2, with the payload's variables.
    assert seen["subject"] == "Good news, Jane: order O-7 has shipped"
    assert "with DHL" in seen["text"] and "https://track.example.com/O-7" in seen["text"]
    assert 'href="https://track.example.com/O-7"' in seen["html"]
    assert seen["metadata"]["template"] == "shipping-notice"
    assert event(engine, event_id).status == "done"

    # `email-platform trace`, once the warehouse is built, shows it as a local template's.
    path = tmp_path / "warehouse.duckdb"
    refresh(engine, path)
    env = {"EMAIL_PLATFORM_DATABASE_URL": database_url, "EMAIL_PLATFORM_WAREHOUSE": str(path)}
    shown_cli = CliRunner().invoke(main, ["trace", event_id, "--json"], env=env)
    assert shown_cli.exit_code == 0, shown_cli.output
    traced = json.loads(shown_cli.output)
    (shown,) = traced["messages"]
    assert (shown["template"], shown["template_version"]) == ("shipping-notice", 0)
    (row,) = traced["funnel"]
    assert (row["template"], row["template_version"], row["final_status"]) == (
        "shipping-notice",
        0,
        "sent",
    )


def test_a_pinned_version_is_the_one_rendered_and_recorded(engine, database_url, sandbox):
    routes = pinned_routes()
    event_id = _publish(engine, shipped("O-8"), routes, event_type="order.shipped_v1")
    routing = RoutingResource(routes_factory=f"{HERE}:pinned_routes")
    result = run_send(database_url, sandbox.base_url, "transactional", [event_id], routing=routing)
    assert result.success
    (message,) = messages_of(engine, event_id)
    assert (message.status, message.template, message.template_version) == (
        "sent",
        "shipping-notice",
        1,
    )
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    assert seen["subject"] == "Order O-8 has shipped"  # v1's subject, not the live v2's


def test_a_template_the_provider_lacks_is_dead_lettered_alone_naming_it(
    engine, database_url, sandbox
):
    routes = pinned_routes()
    good = [_publish(engine, shipped(f"O-{i}"), routes) for i in range(3)]
    lost = _publish(
        engine, {"first_name": "Jane", "email": "jane@example.com"}, routes, "order.lost"
    )
    routing = RoutingResource(routes_factory=f"{HERE}:pinned_routes")
    result = run_send(
        database_url, sandbox.base_url, "transactional", [good[0], lost, *good[1:]], routing=routing
    )
    assert not result.success  # a dead letter fails the run, as documented
    (message,) = messages_of(engine, lost)
    assert (message.status, message.template, message.template_version) == (
        "dead",
        "no-such-template",
        LIVE_VERSION,
    )
    (letter,) = dead_letters_of(engine, lost)
    assert (letter.reason, letter.error_code) == ("provider_rejected", "template_not_found")
    assert "no-such-template" in letter.last_error
    for event_id in good:
        (sent,) = messages_of(engine, event_id)
        assert sent.status == "sent" and sent.attempts == 1
        assert len(sandbox_messages(sandbox.base_url, event_id)) == 1


@pytest.fixture(scope="module")
def postfix() -> Iterator[Postfix]:
    server = start_postfix()
    try:
        yield server
    finally:
        server.stop()


def test_through_smtp_the_routes_local_fallback_is_rendered_and_recorded(
    engine, database_url, postfix
):
    """Postfix has no templates of ours: the demo route's local ``shipping_notice`` goes."""
    to = f"ship-{database_url[:4]}-{uuid.uuid4().hex[:8]}@example.com"
    event_id = _publish(engine, shipped("O-9", email=to))
    resource = EmailProviderResource(
        provider="smtp",
        base_url=f"smtp://127.0.0.1:{postfix.port('plain')}",
        timeout_s=10.0,
        options_json=json.dumps({"starttls": "false"}),
    )
    result = run_send(database_url, "unused", "transactional", [event_id], provider=resource)
    assert result.success
    ((raw, _),) = postfix.wait_delivered(to)
    assert b"Subject: Order O-9 has shipped" in raw
    (message,) = messages_of(engine, event_id)
    assert (message.status, message.template, message.template_version) == (
        "sent",
        "shipping_notice",
        1,
    )


def test_a_letter_dead_for_a_missing_template_is_sent_once_replayed_after_it_is_added(
    engine, database_url, tmp_path
):
    """The provider lacked the template (422): dead-lettered; the template is created in the
    provider's editor; ``dlq replay`` sends it once, under the key committed before."""
    folder = tmp_path / "provider"
    folder.mkdir()
    with SandboxServer(SandboxConfig(provider_templates=str(folder))) as url:
        event_id = _publish(engine, shipped("O-5"))
        assert not run_send(database_url, url, "transactional", [event_id]).success
        (letter,) = dead_letters_of(engine, event_id)
        assert letter.error_code == "template_not_found"
        shutil.copytree(SHIPPED / "shipping-notice", folder / "shipping-notice")
        (tmp_path / "dagster").mkdir()
        replayed = CliRunner().invoke(
            main,
            ["dlq", "replay", "--all", "--inline"],
            env={
                "EMAIL_PLATFORM_DATABASE_URL": database_url,
                "EMAIL_PLATFORM_SANDBOX_BASE_URL": url,
                "DAGSTER_HOME": str(tmp_path / "dagster"),
            },
        )
        assert replayed.exit_code == 0, replayed.output
        (message,) = messages_of(engine, event_id)
        assert (message.status, message.template, message.template_version) == (
            "sent",
            "shipping-notice",
            LIVE_VERSION,
        )
        (seen,) = sandbox_messages(url)
        assert seen["idempotency_key"] == message.idempotency_key == f"{event_id}:shipping_notice"
        assert seen["subject"] == "Good news, Jane: order O-5 has shipped"
