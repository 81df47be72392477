"""Optional OpenTelemetry spans that carry the publisher's trace through the email's life.

With ``opentelemetry-api`` installed and a tracer provider configured (the SDK's
``TracerProvider``, set with ``trace.set_tracer_provider``), ``publish()`` stores the caller's
W3C trace context on the outbox row, and the claim, render, provider call, webhook ingestion and
warehouse refresh emit spans of the tracer ``email_platform`` that continue it. Without the
package, or with no provider configured, every function here is a no-op that costs one check,
and the send path looks once per batch (``active()``) and then skips span work altogether.

Stored contexts are W3C Trace Context only (``traceparent``, ``tracestate``), written and read
with the W3C propagator whatever the global propagators are: baggage, which may carry user data,
never reaches the database. Spans carry ids (event, message, provider message), never addresses,
payloads or provider error texts (which can quote an address).
"""

import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

try:
    from opentelemetry import trace as _otel
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # tracing is the optional extra ``email_platform[tracing]``
    _otel = None
    _W3C = None
else:
    _W3C = TraceContextTextMapPropagator()

TRACER_NAME = "email_platform"
#: A stored W3C context: ``{"traceparent": ..., "tracestate": ...}``.
Carrier = Mapping[str, str]

#: What ``start_span`` returns when tracing is off; a caller that checked ``active()`` once
#: per batch uses it directly instead of asking again per message.
NO_SPAN: AbstractContextManager[None] = nullcontext(None)
#: (provider, its email_platform tracer): looked up again only when the provider changes.
_cached: tuple[Any, Any] | None = None


def _tracer() -> Any | None:
    """The ``email_platform`` tracer of the configured provider, or None when there is none."""
    global _cached
    if _otel is None:
        return None
    provider = _otel.get_tracer_provider()
    cached = _cached
    if cached is not None and cached[0] is provider:
        return cached[1]
    # The API's defaults when nothing is configured: spans there would record nothing.
    if isinstance(provider, (_otel.ProxyTracerProvider, _otel.NoOpTracerProvider)):
        return None
    tracer = provider.get_tracer(TRACER_NAME)
    _cached = (provider, tracer)
    return tracer


def active() -> bool:
    """OpenTelemetry is installed and a tracer provider is configured."""
    return _tracer() is not None


def now_ns() -> int:
    """A span start time (``time.time_ns``), taken before the work it will cover."""
    return time.time_ns()


def publish_context(
    start_ns: int, attributes: Mapping[str, Any]
) -> tuple[dict[str, str] | None, str | None]:
    """What ``publish()`` stores for one event: the W3C context its email continues, and the
    trace id (32 hex digits). ``(None, None)`` unless a span is current.

    With a tracer provider, an ``email_platform.publish`` span (kind PRODUCER, a child of the
    caller's span, from ``start_ns`` to now) is recorded and its context stored, so each event
    of a ``publish_many`` has a context of its own (the messaging conventions' "create" span).
    Without one (the API alone, the caller's context propagated from elsewhere), the caller's
    context itself is stored.
    """
    if _otel is None:
        return None, None
    caller = _otel.get_current_span().get_span_context()
    if not caller.is_valid:
        return None, None
    tracer = _tracer()
    context = None
    trace_id = caller.trace_id
    if tracer is not None:
        span = tracer.start_span(
            "email_platform.publish",
            kind=SpanKind.PRODUCER,
            attributes=_clean(attributes),
            start_time=start_ns,
        )
        span.end()
        context = _otel.set_span_in_context(span)
        trace_id = span.get_span_context().trace_id
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=context)
    return carrier or None, _otel.format_trace_id(trace_id)


def start_span(
    name: str,
    *,
    context_carrier: Any = None,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
    links: Iterable[Any] = (),
    start_time_ns: int | None = None,
) -> AbstractContextManager[Any]:
    """A span around the block, made current, yielded (None when tracing is off).

    It continues the trace of ``context_carrier`` (a stored W3C context) when that is a
    mapping, else it is a child of the current span. ``links`` are stored contexts to link to
    (the events a batch claims). An exception leaving the block is recorded on the span.
    """
    tracer = _tracer()
    if tracer is None:
        return NO_SPAN
    return tracer.start_as_current_span(
        name,
        context=_context(context_carrier),
        kind=_kind(kind),
        attributes=_clean(attributes),
        links=_links(links),
        start_time=start_time_ns,
    )


def open_span(
    name: str,
    *,
    context_carrier: Any = None,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
) -> Any | None:
    """A started span that ``end_span`` ends (for spans the caller keeps several of at once,
    such as one per message of a batch call), or None when tracing is off."""
    tracer = _tracer()
    if tracer is None:
        return None
    return tracer.start_span(
        name, context=_context(context_carrier), kind=_kind(kind), attributes=_clean(attributes)
    )


def end_span(
    span: Any | None, *, error: str | None = None, attributes: Mapping[str, Any] | None = None
) -> None:
    """End ``span`` (None is ignored), with an error status when ``error`` says why."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def record_span(
    name: str,
    *,
    start_time_ns: int,
    context_carrier: Any = None,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
) -> None:
    """A finished span from ``start_time_ns`` to now; nothing when tracing is off."""
    tracer = _tracer()
    if tracer is None:
        return
    tracer.start_span(
        name,
        context=_context(context_carrier),
        kind=_kind(kind),
        attributes=_clean(attributes),
        start_time=start_time_ns,
    ).end()


def use(span: Any | None) -> AbstractContextManager[Any]:
    """Make ``span`` current for the block (child spans, e.g. an HTTP client's, nest under it)."""
    if span is None:
        return NO_SPAN
    return _otel.use_span(span, end_on_exit=False)


def set_attributes(span: Any | None, attributes: Mapping[str, Any]) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


def carrier_of(span: Any | None) -> dict[str, str] | None:
    """The W3C context of ``span``, as stored (None for no span)."""
    if span is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=_otel.set_span_in_context(span))
    return carrier or None


def log_fields(item: Any) -> str:
    """`` trace_id=... correlation_id=...`` for a log line naming an event (an outbox row, an
    ``OutgoingEmail``), or "" when it has neither. ``publish()`` admits only printable ids;
    anything else (a row written by hand) is quoted, so it cannot forge a log line."""
    parts = []
    for name in ("trace_id", "correlation_id"):
        value = getattr(item, name, None)
        if value:
            parts.append(f" {name}={value if value.isprintable() else repr(value)}")
    return "".join(parts)


def _context(carrier: Any) -> Any | None:
    if not isinstance(carrier, Mapping):
        return None  # no stored context: the current one is the parent
    return _W3C.extract(carrier)


def _links(carriers: Iterable[Any]) -> list[Any]:
    links = []
    for carrier in carriers:
        context = _context(carrier)
        if context is None:
            continue
        span_context = _otel.get_current_span(context).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    return links


def _kind(name: str) -> Any:
    return getattr(SpanKind, name.upper())


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """OpenTelemetry refuses None values (with a warning per attribute): they are left out."""
    if not attributes:
        return None
    return {key: value for key, value in attributes.items() if value is not None}
