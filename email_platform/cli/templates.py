"""``email-platform templates``: preview a route's mail, and send one real test of it.

``render`` needs no database: the configured route table (``EMAIL_PLATFORM_ROUTES``, or
``--routes``) and its templates, the payload from a JSON file. ``send-test`` sends one message
through the configured provider now and records it as a test, kept out of the funnel
(``sending.trial_send``; docs/templates.md).
"""

import json
from pathlib import Path
from typing import Any

import click

from email_platform.cli.support import migrated_engine
from email_platform.cli.support import print_json as _print_json
from email_platform.common.errors import (
    ConfigurationError,
    PermanentError,
    PublishError,
    TemplateRenderError,
)
from email_platform.mail.rendering import RenderedEmail, TemplateRenderer
from email_platform.mail.routes import Route, RouteTable, configured_routes, load_routes

_ROUTES_HELP = "Route table as 'package.module:NAME' (default: EMAIL_PLATFORM_ROUTES)."
_PAYLOAD_HELP = "JSON file with the event's payload (at the routed version); '-' reads stdin."
_LOCALE_HELP = "Render in this locale (pt-BR, pt, ...) instead of the payload's."


@click.group()
def templates() -> None:
    """Preview a route's mail; send one real test message."""


def _table(routes: str | None) -> RouteTable:
    try:
        return load_routes(routes) if routes else configured_routes()
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


def _route(table: RouteTable, name: str) -> Route:
    try:
        return table.route(name)
    except KeyError as exc:
        raise click.ClickException(str(exc.args[0])) from None


def _renderer(table: RouteTable, templates_dir: Path | None) -> TemplateRenderer:
    directory = templates_dir or table.templates_dir
    if directory is None:
        raise click.ClickException("the route table names no templates_dir: pass --templates-dir")
    return TemplateRenderer(directory)


def _payload(file: Any) -> dict[str, Any] | None:
    if file is None:
        return None
    try:
        value = json.loads(file.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"--payload {file.name}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise click.ClickException(f"--payload {file.name}: must hold a JSON object")
    return value


def _rendering_error(exc: Exception) -> click.ClickException:
    if isinstance(exc, TemplateRenderError):
        code = getattr(exc, "code", None) or exc.reason
        return click.ClickException(
            f"cannot render: {exc} ({code}; does the payload hold every field it reads?)"
        )
    return click.ClickException(str(exc))


def _echo(rendered: RenderedEmail, route: Route) -> None:
    locale = rendered.locale or "default"
    click.echo(f"route: {route.name}  template: {rendered.template} v{rendered.template_version}")
    click.echo(f"locale: {locale}")
    click.echo(f"subject: {rendered.subject}")
    click.echo("--- text ---")
    click.echo(rendered.text)
    click.echo("--- html ---")
    click.echo(rendered.html if rendered.html is not None else "(no HTML part)")


def _as_json(rendered: RenderedEmail, route: Route, **extra: Any) -> dict[str, Any]:
    return {
        "route": route.name,
        "template": rendered.template,
        "template_version": rendered.template_version,
        "locale": rendered.locale,
        "subject": rendered.subject,
        "text": rendered.text,
        "html": rendered.html,
        **extra,
    }


_templates_dir = click.option(
    "--templates-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Templates folder (default: the route table's templates_dir).",
)


@templates.command("render")
@click.argument("route")
@click.option("--payload", "payload_file", type=click.File("rb"), required=True, help=_PAYLOAD_HELP)
@click.option("--locale", help=_LOCALE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--routes", help=_ROUTES_HELP)
@_templates_dir
def render(
    route: str,
    payload_file: Any,
    locale: str | None,
    as_json: bool,
    routes: str | None,
    templates_dir: Path | None,
) -> None:
    """Print the subject, text and HTML that ROUTE sends for a payload; nothing is sent."""
    from email_platform.sending.trial_send import render_for

    table = _table(routes)
    chosen = _route(table, route)
    payload = _payload(payload_file) or {}
    hosted = _provider_template(chosen, payload)
    if hosted is not None and not chosen.template:
        # Rendered only at the provider: what it is sent is all there is to show.
        if as_json:
            _print_json({"route": chosen.name, "provider_template": hosted})
        else:
            click.echo(f"route: {chosen.name}  provider template: {_describe(hosted)}")
        return
    try:
        rendered = render_for(table, _renderer(table, templates_dir), chosen, payload, locale)
    except (TemplateRenderError, PublishError) as exc:
        raise _rendering_error(exc) from None
    if as_json:
        _print_json(_as_json(rendered, chosen, provider_template=hosted))
    else:
        if hosted is not None:
            click.echo(f"provider template: {_describe(hosted)}")
            click.echo("(below: the local fallback, what an adapter without templates sends)")
        _echo(rendered, chosen)


def _provider_template(route: Route, payload: dict[str, Any]) -> dict[str, Any] | None:
    """The provider template call ROUTE makes for ``payload`` (id, version, variables)."""
    if route.provider_template is None:
        return None
    try:
        call = route.provider_template.call(payload)
    except TemplateRenderError as exc:
        raise _rendering_error(exc) from None
    return {"id": call.id, "version": call.version, "variables": call.variables}


def _describe(hosted: dict[str, Any]) -> str:
    version = "live" if hosted["version"] is None else hosted["version"]
    return f"{hosted['id']} ({version})  variables: {json.dumps(hosted['variables'])}"


@templates.command("send-test")
@click.argument("route")
@click.option("--to", "to", required=True, help="The address to send the test message to.")
@click.option(
    "--payload",
    "payload_file",
    type=click.File("rb"),
    help=_PAYLOAD_HELP + " Default: the route's schema example.",
)
@click.option("--locale", help=_LOCALE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--routes", help=_ROUTES_HELP)
@_templates_dir
@click.option("--url", help="SQLAlchemy URL of the application database.")
def send_test(
    route: str,
    to: str,
    payload_file: Any,
    locale: str | None,
    as_json: bool,
    routes: str | None,
    templates_dir: Path | None,
    url: str | None,
) -> None:
    """Send one real ROUTE message to --to through the configured provider, now.

    Recorded as a test (trace shows it; the analytics funnel leaves it out). Prints the
    provider's message id; exits 1 if the provider refused it.
    """
    from email_platform.common import config
    from email_platform.providers.registry import open_provider
    from email_platform.sending.trial_send import send_test as send_one

    table = _table(routes)
    _route(table, route)
    renderer = _renderer(table, templates_dir)
    payload = _payload(payload_file)
    engine = migrated_engine(url)
    try:
        settings = config.ProviderSettings.from_env()
        provider = open_provider(settings, max_connections=1)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        result = send_one(
            engine,
            table,
            renderer,
            provider,
            route_name=route,
            to=to,
            sender=settings.sender,
            payload=payload,
            locale=locale,
        )
    except (TemplateRenderError, PublishError, PermanentError, ConfigurationError) as exc:
        raise _rendering_error(exc) from None
    finally:
        provider.close()
    chosen = table.route(route)
    if as_json:
        _print_json(
            _as_json(
                result.rendered,
                chosen,
                event_id=result.event_id,
                message_id=result.message_id,
                provider=result.provider,
                provider_message_id=result.provider_message_id,
                error=str(result.error) if result.error else None,
            )
        )
    if result.error is not None:
        raise click.ClickException(
            f"{result.provider} refused the test message {result.message_id} "
            f"(event {result.event_id}): {result.error}"
        )
    if not as_json:
        click.echo(
            f"sent test message {result.message_id} (event {result.event_id}, "
            f"locale {result.rendered.locale or 'default'}) via {result.provider}: "
            f"{result.provider_message_id}"
        )
