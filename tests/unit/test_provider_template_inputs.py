"""Provider-template variables come from the producer: whatever a payload holds, ``publish()``
either accepts it and then every adapter that has templates sends the message or refuses it with a
named permanent cause, or ``publish()`` refuses it with a ``PublishError`` naming the field. Never
another exception (hypothesis over values, nesting, sizes, text and a variables function).
Also: the route's and the template's own rules, and the start-up check naming route and provider.
"""

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, create_engine

from email_platform import publish
from email_platform.common.errors import (
    ConfigurationError,
    HeaderInjectionError,
    InvalidPayloadError,
    PermanentError,
    PublishError,
)
from email_platform.common.lanes import Lane
from email_platform.db.schema import metadata
from email_platform.mail.provider_templates import (
    LIVE_VERSION,
    MAX_VARIABLES_BYTES,
    MAX_VARIABLES_DEPTH,
    ProviderTemplate,
)
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import Route, RouteTable, demo_routes
from email_platform.providers import templated
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.failover import FailoverProvider, FailoverState
from email_platform.providers.smtp import SmtpProvider
from email_platform.sandbox.templates import ProviderTemplates
from tests.unit.test_adapters_send_or_name_the_cause import ADAPTERS, _accept

EVENT_ID = "01JDQ5Z3K8M9N0P1Q2R3S4T5V6"


def _shipping(variables: Any = ("first_name", "order_id", "carrier")) -> Route:
    return Route(
        name="shipping",
        event_type="order.shipped",
        event_version=1,
        template="",
        lane=Lane.TRANSACTIONAL,
        header_fields=("first_name",),
        provider_template=ProviderTemplate("shipping-notice", variables=variables),
    )


def _table(route: Route) -> RouteTable:
    return RouteTable(routes=[route])  # no schemas: the route's own checks answer


@pytest.fixture(scope="module")
def connection() -> Iterator[Connection]:
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    with engine.connect() as connection:
        yield connection
    engine.dispose()


def _publish(connection: Connection, routes: RouteTable, payload: dict) -> str:
    with connection.begin():
        return publish(
            connection,
            event_type="order.shipped",
            aggregate_id="o1",
            payload=payload,
            routes=routes,
        )


def _sent_or_named(route: Route, payload: dict) -> None:
    """What publish() accepted, every adapter with templates sends or refuses by name."""
    assert route.provider_template is not None
    call = route.provider_template.call(payload)
    email = OutgoingEmail(
        message_id=1,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:shipping",
        sender="Shop <no-reply@example.com>",
        to="jane@example.com",
        subject="",
        text="",
        html=None,
        template=route.template,
        lane="transactional",
        headers={"X-Email-Event-Id": EVENT_ID},
        provider_template=call,
    )
    for provider, make in ADAPTERS.items():
        adapter = make(httpx.MockTransport(_accept))
        try:
            adapter.send(email)
        except PermanentError as error:
            assert error.code and error.code != "unexpected", (provider, error)
        finally:
            adapter.close()


_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities included: JSON cannot carry them
    | st.text(max_size=40)  # control characters, lone surrogates and all
)
_VALUE = st.recursive(
    _SCALAR,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(carrier=_VALUE, first_name=st.text(max_size=30), drop=st.booleans())
def test_publish_refuses_by_field_or_every_adapter_sends_or_names_the_cause(
    connection, carrier, first_name, drop
):
    route = _shipping()
    payload: dict[str, Any] = {"email": "jane@example.com", "order_id": "O-1"}
    payload["first_name"] = first_name
    if not drop:
        payload["carrier"] = carrier
    try:
        _publish(connection, _table(route), payload)
    except PublishError as error:
        assert error.field.startswith("payload"), error
        return
    _sent_or_named(route, payload)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(made=st.one_of(_VALUE, st.just({1: "a"}), st.just({"b": b"x"}), st.just({"s": {1, 2}})))
def test_a_variables_function_returning_anything_is_refused_at_publish_or_sent(connection, made):
    route = _shipping(variables=lambda payload: made)
    payload = {"email": "jane@example.com", "order_id": "O-1", "first_name": "Jane"}
    try:
        _publish(connection, _table(route), payload)
    except PublishError as error:
        assert isinstance(error, InvalidPayloadError) and error.field.startswith("payload"), error
        return
    _sent_or_named(route, payload)


def test_a_missing_variable_is_refused_naming_its_field(connection):
    with pytest.raises(InvalidPayloadError) as info:
        _publish(connection, _table(_shipping()), {"email": "j@example.com", "order_id": "O-1"})
    assert info.value.field == "payload.first_name"
    assert "shipping-notice" in str(info.value)


@pytest.mark.parametrize(
    ("carrier", "why"),
    [
        ("x" * (MAX_VARIABLES_BYTES + 1), "bytes; the limit"),
        ([[[[[[[[["deep"]]]]]]]]], f"deeper than {MAX_VARIABLES_DEPTH}"),
        (float("nan"), "not JSON"),
    ],
    ids=["too large", "too deep", "NaN"],
)
def test_variables_beyond_the_bounds_are_refused_naming_the_field(connection, carrier, why):
    payload = {"email": "j@example.com", "order_id": "O-1", "first_name": "J", "carrier": carrier}
    with pytest.raises(InvalidPayloadError) as info:
        _publish(connection, _table(_shipping()), payload)
    assert info.value.field.startswith("payload") and why in str(info.value), info.value


def test_a_line_break_in_a_field_the_provider_puts_in_its_subject_is_refused(connection):
    payload = {"email": "j@example.com", "order_id": "O-1", "first_name": "J\r\nBcc: x@example.com"}
    payload["carrier"] = "DHL"
    with pytest.raises(HeaderInjectionError) as info:
        _publish(connection, _table(_shipping()), payload)
    assert info.value.field == "payload.first_name"


def test_the_demo_route_records_the_template_id_and_the_live_version():
    route = demo_routes().route("shipping_notice")
    assert route.provider_template is not None
    assert route.provider_template.id in ProviderTemplates().known()  # the sandbox has it
    assert route.provider_template.recorded_version == LIVE_VERSION
    assert TemplateRenderer().latest_version(route.template) == 1  # the local fallback


def test_smtp_renders_a_routes_local_fallback_and_starts():
    templated.check_routes(demo_routes().routes, _smtp(), TemplateRenderer())
    assert not templated.sends_templates(_smtp())


@pytest.mark.parametrize(("version", "recorded"), [(None, 0), (3, 3), ("v12", 12), ("7", 7)])
def test_a_version_is_recorded_as_its_number(version, recorded):
    assert ProviderTemplate("t", version=version).recorded_version == recorded


@pytest.mark.parametrize(
    "changes",
    [
        {"id": ""},
        {"id": "../etc"},
        {"id": "a\r\nb"},
        {"id": "x" * 101},
        {"version": 0},
        {"version": True},
        {"version": "latest"},
        {"variables": ("ok", "not a field")},
    ],
)
def test_a_template_that_cannot_be_recorded_or_sent_is_refused_when_the_route_is_made(changes):
    fields = {"id": "t", "version": None, "variables": ()}
    with pytest.raises(ValueError):
        ProviderTemplate(**{**fields, **changes})


def test_a_route_pins_its_provider_templates_version_in_one_place():
    with pytest.raises(ValueError, match="ProviderTemplate"):
        dataclasses.replace(_shipping(), template_version=2)


def _smtp() -> SmtpProvider:
    return SmtpProvider("127.0.0.1", 2525, starttls="false")


def test_smtp_with_a_route_on_a_provider_template_fails_at_start_up_naming_both():
    with pytest.raises(ConfigurationError) as info:
        templated.check_routes([_shipping()], _smtp(), TemplateRenderer())
    assert "route shipping" in str(info.value) and "provider smtp" in str(info.value)


def test_a_failover_secondary_that_cannot_send_it_fails_at_start_up_too():
    primary = ADAPTERS["postmark"](httpx.MockTransport(_accept))
    provider = FailoverProvider(primary, _smtp(), FailoverState(mock_breaker()))
    try:
        with pytest.raises(ConfigurationError, match="provider smtp"):
            templated.check_routes([_shipping()], provider, TemplateRenderer())
    finally:
        primary.close()


def mock_breaker():  # type: ignore[no-untyped-def]
    from email_platform.providers.circuit import CircuitBreaker

    return CircuitBreaker()


@pytest.mark.parametrize("provider", ["postmark", "sendgrid", "ses", "resend"])
def test_a_pinned_version_where_only_the_live_one_can_be_sent_fails_at_start_up(provider):
    route = Route(
        name="pinned",
        event_type="order.shipped",
        event_version=1,
        template="",
        lane=Lane.TRANSACTIONAL,
        provider_template=ProviderTemplate("shipping-notice", version=2),
    )
    adapter = ADAPTERS[provider](httpx.MockTransport(_accept))
    try:
        with pytest.raises(ConfigurationError, match=f"route pinned .* provider {provider}"):
            templated.check_routes([route], adapter, TemplateRenderer())
        templated.check_routes([_shipping()], adapter, TemplateRenderer())  # the live version: fine
    finally:
        adapter.close()


def test_smtp_refuses_a_templated_message_that_reached_it_anyway_naming_the_cause():
    email = OutgoingEmail(
        message_id=1,
        event_id=EVENT_ID,
        idempotency_key="k",
        sender="no-reply@example.com",
        to="jane@example.com",
        subject="",
        text="",
        html=None,
        template="shipping-notice",
        lane="transactional",
        provider_template=_shipping().provider_template.call(  # type: ignore[union-attr]
            {"first_name": "J", "order_id": "1", "carrier": "DHL"}
        ),
    )
    with pytest.raises(PermanentError) as info:
        _smtp().build_message(email)
    assert info.value.code == "provider_template_unsupported"


def test_a_templated_message_with_addresses_and_a_file_is_sent_or_refused_by_name():
    from email_platform.mail.addressing import Attachment

    call = _shipping().provider_template.call(  # type: ignore[union-attr]
        {"first_name": "J", "order_id": "1", "carrier": "DHL"}
    )
    email = OutgoingEmail(
        message_id=1,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:shipping",
        sender="Shop <no-reply@example.com>",
        to="jane@example.com",
        subject="",
        text="",
        html=None,
        template="shipping-notice",
        lane="transactional",
        provider_template=call,
        reply_to=("Support <support@example.com>",),
        cc=("ops@example.com",),
        attachments=(Attachment("label.pdf", "application/pdf", b"%PDF-1.4 label"),),
    )
    refused = {}
    for provider, make in ADAPTERS.items():
        adapter = make(httpx.MockTransport(_accept))
        try:
            adapter.send(email)
        except PermanentError as error:
            refused[provider] = error.code
        finally:
            adapter.close()
    # Only SES cannot: its files go as raw MIME, which cannot name a template.
    assert refused == {"ses": "provider_template_unsupported"}
