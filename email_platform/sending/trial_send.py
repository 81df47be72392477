"""Test sends: one real message of a route, to an address the operator gives, sent now.

``email-platform templates send-test ROUTE --to ADDRESS`` renders the route's template (with the
payload given, else its schema's example) and hands it to the configured provider's adapter in
this process, synchronously: no lane, no claim, no retry. A route on a provider template goes as
the send path sends it, as that template's call, which the provider renders. It is recorded so
it can be traced like any mail (an outbox row already ``done`` with resolution ``test``, a
message with ``is_test`` true and an attempt), and kept out of the warehouse's funnel and
staging views. Nothing is written before the template rendered and the address passed
``publish()``'s check.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from email_platform.common.classify import classify_exception
from email_platform.common.errors import DeliveryError, TransientError
from email_platform.common.ids import new_ulid
from email_platform.common.timeutil import utcnow
from email_platform.mail import addressing, locales, provider_templates
from email_platform.mail.rendering import RenderedEmail, TemplateRenderer
from email_platform.mail.routes import Route, RouteTable
from email_platform.providers import templated
from email_platform.providers.base import EmailProvider, OutgoingEmail
from email_platform.publishing.validation import check_address, check_payload
from email_platform.store import attempts, messages, outbox

#: The outbox resolution and message flag that mark a test send (the warehouse leaves both out).
RESOLUTION = "test"
#: The header that tells a reader (and a provider's logs) the mail was a test.
TEST_HEADER = "X-Email-Test-Send"
PRODUCER = "email-platform templates send-test"


@dataclass(frozen=True)
class TrialResult:
    event_id: str
    message_id: int
    provider: str
    provider_message_id: str | None
    rendered: RenderedEmail
    #: None when the provider accepted it; else the named cause.
    error: DeliveryError | None = None


def example_payload(routes: RouteTable, route: Route) -> dict[str, Any]:
    """The first example of the route's declared schema, or an empty payload."""
    schema = routes.schema_for(route.event_type, route.event_version) or {}
    examples = schema.get("examples") or [{}]
    return dict(examples[0]) if isinstance(examples[0], Mapping) else {}


def render_for(
    routes: RouteTable,
    renderer: TemplateRenderer,
    route: Route,
    payload: Mapping[str, Any],
    locale: str | None = None,
) -> RenderedEmail:
    """What ``route`` sends for ``payload`` (already at the routed version), as the send path
    renders it; ``locale`` (checked: ``InvalidLocaleError``) replaces the route's own."""
    if route.locale_field and not locale:  # refused as publish() refuses it
        locales.check_locale(f"payload.{route.locale_field}", payload.get(route.locale_field))
    asked = locales.check_locale("locale", locale) if locale else locales.requested(route, payload)
    version = route.template_version or renderer.latest_version(route.template)
    return renderer.render(route.template, version, dict(payload), asked)


def send_test(
    engine: Engine,
    routes: RouteTable,
    renderer: TemplateRenderer,
    provider: EmailProvider,
    *,
    route_name: str,
    to: str,
    sender: str,
    payload: Mapping[str, Any] | None = None,
    locale: str | None = None,
) -> TrialResult:
    """Render, record and send one test message of ``route_name`` to ``to``.

    Raises ``KeyError`` (no such route), ``PublishError`` (a bad address or locale),
    ``TemplateRenderError``, ``ConfigurationError`` (the adapter cannot carry what the route
    sets) or ``PermanentError`` (its addresses or files) before anything is written; a
    provider's refusal is recorded on the message (status ``dead``, its attempt) and returned
    as ``error``.
    """
    route = routes.route(route_name)
    address = check_address("to", to)
    # Stored in the outbox like a published payload, so checked like one.
    data = check_payload(example_payload(routes, route) if payload is None else payload)
    data[route.recipient_field or "email"] = address
    # A route on a provider template goes as the send path sends it: the provider renders it.
    hosted = route.provider_template if templated.sends_templates(provider) else None
    call = None
    if hosted is not None:
        if locale:  # refused as for a local template; the provider picks its own language
            locales.check_locale("locale", locale)
        call = hosted.call(data)
        rendered = provider_templates.stand_in(hosted.id, hosted.recorded_version)
    else:
        rendered = render_for(routes, renderer, route, data, locale)
    # Addressed and with its files as the send path makes them, so the test shows the real mail.
    addressing.refuse_uncarried(provider, [route])
    addressed = addressing.address(route, data, sender)
    files = addressing.attachments_for(route, data)
    now = utcnow()
    event_id = new_ulid()
    with engine.begin() as connection:
        outbox.insert_event(
            connection,
            {
                "event_id": event_id,
                "event_type": route.event_type,
                "event_version": route.event_version,
                "aggregate_id": "templates-send-test",
                "occurred_at": now,
                "published_at": now,
                "payload": data,
                "event_metadata": {"test_send": True},
                "lane": route.lane.value,
                "available_at": now,
                # Done from the start: no sensor or worker ever claims it.
                "status": outbox.DONE,
                "resolution": RESOLUTION,
                "done_at": now,
                "producer": PRODUCER,
            },
        )
        message = messages.create(
            connection,
            {
                "event_id": event_id,
                "route": route.name,
                "template": rendered.template,
                "template_version": rendered.template_version,
                "lane": route.lane.value,
                "recipient": address,
                "recipient_domain": address.rsplit("@", 1)[-1].lower(),
                "idempotency_key": f"{event_id}:{route.name}:test",
                "status": messages.PENDING,
                "provider": provider.name,
                "created_at": now,
                "updated_at": now,
                "locale": rendered.locale,
                "is_test": True,
            },
        )
    email = OutgoingEmail(
        message_id=message.message_id,
        event_id=event_id,
        idempotency_key=message.idempotency_key,
        sender=addressed.sender,
        to=address,
        subject=rendered.subject,
        text=rendered.text,
        html=rendered.html,
        template=rendered.template,
        lane=route.lane.value,
        headers={"X-Email-Event-Id": event_id, TEST_HEADER: "1"},
        provider_template=call,
        reply_to=addressed.reply_to,
        cc=addressed.cc,
        bcc=addressed.bcc,
        envelope_sender=addressed.envelope_sender,
        attachments=files,
    )
    started = utcnow()
    try:
        accepted = provider.send(email)
        error: DeliveryError | None = None
    except Exception as exc:  # recorded with its class, as the send path classifies it
        accepted, error = None, classify_exception(exc)
    finished = utcnow()
    provider_id = accepted.provider_message_id if accepted is not None else None
    with engine.begin() as connection:
        messages.record_attempt(
            connection,
            message.message_id,
            finished,
            accepted=error is None,
            provider=provider.name,
            provider_message_id=provider_id,
            error=str(error) if error else None,
        )
        if error is not None:  # not retried: the operator sees why and runs it again
            messages.set_status(
                connection, message.message_id, messages.DEAD, finished, last_error=str(error)
            )
        attempts.add(
            connection,
            [
                {
                    "message_id": message.message_id,
                    "event_id": event_id,
                    "run_id": None,
                    "attempt_no": 1,
                    "started_at": started,
                    "finished_at": finished,
                    "outcome": "accepted" if error is None else _outcome(error),
                    "http_status": getattr(accepted or error, "status_code", None),
                    "provider_message_id": provider_id,
                    "error": str(error) if error else None,
                    "provider": provider.name,
                }
            ],
        )
    return TrialResult(event_id, message.message_id, provider.name, provider_id, rendered, error)


def _outcome(error: DeliveryError) -> str:
    return "transient" if isinstance(error, TransientError) else "permanent"
