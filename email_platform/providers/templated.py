"""Each provider's form of a provider-hosted template (``OutgoingEmail.provider_template``), and
which adapters can send one at all (checked when a sender is built, before anything is claimed).

Each adapter builds its request as for any message and hands it here, which swaps the rendered
subject and body for the provider's template fields; everything else the adapter wrote (from,
to, headers, metadata, tags) stays as it is:

* Postmark: ``POST /email/withTemplate`` with ``TemplateAlias`` (or ``TemplateId`` for an id of
  digits) and ``TemplateModel``; no ``Subject``/``TextBody``/``HtmlBody``.
* SendGrid: ``template_id`` and ``personalizations[0].dynamic_template_data``; no ``subject``
  or ``content`` (the template's version holds them).
* Mailgun: ``template``, ``t:version`` when pinned, ``t:variables`` (JSON); no ``subject``,
  ``text`` or ``html``.
* SES v2 ``SendEmail``: ``Content.Template`` with ``TemplateName``, ``TemplateData`` (JSON) and
  the message's ``Headers``.
* Resend: ``template: {"id", "variables"}``; Resend's variables are strings and integers only,
  so a message with another value is refused, permanently, naming the variable.
* Sandbox: ``template: {"id", "version", "variables"}``; the sandbox renders the templates it
  knows (``sandbox/provider_templates``).
* SMTP has no provider to render anything: a route on a provider template renders its local
  fallback template (``Route.template``, when that names one) and without one is a
  ``ConfigurationError`` at start-up naming the route and the provider.

Versions: only the sandbox and Mailgun (``t:version``) take a pinned version; Postmark,
SendGrid, SES and Resend send a template's live (published, active) version, so a pinned
version there is a ``ConfigurationError`` at start-up rather than a version recorded that the
provider never used.
"""

import json
from collections.abc import Iterable
from typing import Any

from email_platform.common.errors import ConfigurationError, PermanentError, TemplateRenderError
from email_platform.mail.provider_templates import ProviderTemplateCall
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import Route
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.http import ProviderRequest

#: Per adapter: None cannot send a provider template, False sends the live version only, True
#: also a pinned one. An adapter class may declare its own ``provider_templates`` instead.
CAPABILITY: dict[str, bool | None] = {
    "sandbox": True,
    "postmark": False,
    "sendgrid": False,
    "mailgun": True,
    "ses": False,
    "resend": False,
    "smtp": None,
}


def _adapters(provider: object) -> list[object]:
    """The adapters a provider sends through (a failover's primary and secondary)."""
    found = [getattr(provider, "primary", None), getattr(provider, "secondary", None)]
    return [a for a in found if a is not None] or [provider]


def _name(adapter: object) -> str:
    return str(getattr(adapter, "name", type(adapter).__name__))


def _capability(adapter: object) -> bool | None:
    return getattr(adapter, "provider_templates", CAPABILITY.get(_name(adapter)))


def _has_local(renderer: TemplateRenderer, template: str) -> bool:
    try:
        return renderer.latest_version(template) >= 1
    except TemplateRenderError:
        return False


def sends_templates(provider: object) -> bool:
    """Whether ``provider`` sends provider templates (every adapter it may use has them);
    if not, a route on one renders its local fallback template (``Route.template``)."""
    return all(_capability(a) is not None for a in _adapters(provider))


def check_routes(routes: Iterable[Route], provider: object, renderer: TemplateRenderer) -> None:
    """A ``ConfigurationError`` naming the route and the provider for the first route on a
    provider template that ``provider`` (or a failover's secondary) cannot send: no adapter
    has templates and the route has no local template to fall back on, only
    one side of a failover has them, or a version is pinned where only the live one is sent."""
    adapters = _adapters(provider)
    lacking = [_name(a) for a in adapters if _capability(a) is None]
    for route in routes:
        template = route.provider_template
        if template is None:
            continue
        if len(lacking) == len(adapters):
            if not _has_local(renderer, route.template):
                raise ConfigurationError(
                    f"route {route.name} uses the provider template {template.id!r}, and "
                    f"provider {lacking[0]} cannot send provider-hosted templates: give the "
                    "route a local template to fall back on (Route(template=...)), or send it "
                    "through a provider that has templates"
                )
            continue
        if lacking:
            raise ConfigurationError(
                f"route {route.name} uses the provider template {template.id!r}, and provider "
                f"{lacking[0]} (one side of a failover) cannot send provider-hosted templates"
            )
        for adapter in adapters:
            if template.version is not None and not _capability(adapter):
                raise ConfigurationError(
                    f"route {route.name} pins version {template.version!r} of the provider "
                    f"template {template.id!r}, and provider {_name(adapter)} sends only a "
                    "template's live version: drop the version (recorded as 0, the live one)"
                )


def _call(email: OutgoingEmail) -> ProviderTemplateCall:
    assert email.provider_template is not None
    return email.provider_template


def _json(variables: dict[str, Any]) -> str:
    return json.dumps(variables, separators=(",", ":"))


def postmark_request(body: dict[str, Any], email: OutgoingEmail) -> ProviderRequest:
    """Postmark's ``/email/withTemplate`` request from the ``/email`` body built for ``email``."""
    call = _call(email)
    for name in ("Subject", "TextBody", "HtmlBody"):
        body.pop(name, None)
    if call.id.isdigit():
        body["TemplateId"] = int(call.id)
    else:
        body["TemplateAlias"] = call.id
    body["TemplateModel"] = call.variables
    return ProviderRequest("POST", "/email/withTemplate", json=body)


def sendgrid_body(body: dict[str, Any], email: OutgoingEmail) -> None:
    """The Mail Send body with the dynamic template in place of subject and content."""
    if email.provider_template is None:
        return
    call = email.provider_template
    body.pop("subject", None)
    body.pop("content", None)
    body["template_id"] = call.id
    body["personalizations"][0]["dynamic_template_data"] = call.variables


def mailgun_fields(fields: dict[str, str], email: OutgoingEmail) -> None:
    """The Messages API form with the stored template in place of subject and body."""
    if email.provider_template is None:
        return
    call = email.provider_template
    for name in ("subject", "text", "html"):
        fields.pop(name, None)
    fields["template"] = call.id
    if call.version is not None:
        fields["t:version"] = str(call.version)
    fields["t:variables"] = _json(call.variables)


def ses_body(request: dict[str, Any], email: OutgoingEmail) -> None:
    """``SendEmail`` with ``Content.Template`` in place of ``Content.Simple``."""
    if email.provider_template is None:
        return
    call = email.provider_template
    if "Simple" not in request["Content"]:
        # Files go out as raw MIME, which a template send cannot be.
        raise PermanentError(
            "SES sends a provider template without attachments; this message has "
            f"{len(email.attachments)}",
            code="provider_template_unsupported",
        )
    simple = request["Content"].pop("Simple")
    request["Content"]["Template"] = {
        "TemplateName": call.id,
        "TemplateData": _json(call.variables),
        "Headers": simple["Headers"],
    }


def resend_body(body: dict[str, Any], email: OutgoingEmail) -> None:
    """The send-email body with ``template`` in place of subject, text and html."""
    if email.provider_template is None:
        return
    call = email.provider_template
    for key, value in call.variables.items():
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise PermanentError(
                f"Resend template variables are strings or integers; {key!r} is a "
                f"{type(value).__name__}",
                code="template_variables_unsupported",
            )
    for name in ("subject", "text", "html"):
        body.pop(name, None)
    body["template"] = {"id": call.id, "variables": call.variables}


def sandbox_body(body: dict[str, Any], email: OutgoingEmail) -> None:
    """The sandbox's body with ``template`` (its server renders the templates it knows)."""
    if email.provider_template is None:
        return
    call = email.provider_template
    body["template"] = {"id": call.id, "version": call.version, "variables": call.variables}


def refuse(email: OutgoingEmail, provider: str) -> None:
    """For an adapter that has no templates (SMTP): a permanent error naming the cause, should
    a message reach it despite the start-up check (a route table changed under a run)."""
    if email.provider_template is not None:
        raise PermanentError(
            f"provider {provider} cannot send the provider template {email.provider_template.id!r}",
            code="provider_template_unsupported",
        )
