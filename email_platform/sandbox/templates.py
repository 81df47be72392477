"""The provider-hosted templates the sandbox knows, rendered as a provider renders its own.

A message whose body carries ``template: {"id", "version", "variables"}`` (the sandbox adapter's
form of a provider template) is rendered here before it is checked and accepted: its subject,
text and HTML come from ``<directory>/<id>/v<n>/{subject.txt,text.txt,html.html}`` (Jinja, strict
about missing variables), version None meaning the newest, the provider's "live" one. Shipped:
``provider_templates/`` beside this module (the demo's ``shipping-notice``); a test or a demo may
point ``SandboxConfig.provider_templates`` elsewhere.

As a real provider answers 4xx, an unknown template or version is a 422 ``template_not_found``
naming it, and a rendering that fails (a variable missing, a subject with a line break) a 422
``template_error``: permanent, so the message is dead-lettered with the cause.
"""

import re
from pathlib import Path
from typing import Any

from email_platform.common.errors import TemplateRenderError
from email_platform.mail.rendering import TemplateRenderer

SHIPPED = Path(__file__).parent / "provider_templates"
_TAGGED = re.compile(r"[A-Za-z0-9_.-]{0,40}?(\d{1,9})")


class ProviderTemplates:
    """The sandbox's template registry: one folder of ``<id>/v<n>/`` templates."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else SHIPPED
        self.renderer = TemplateRenderer(self.directory)

    def known(self) -> set[str]:
        """The template ids there are (only a direct child folder's name is ever a path)."""
        if not self.directory.is_dir():
            return set()
        return {p.name for p in self.directory.iterdir() if p.is_dir()}

    def fill(self, payload: Any) -> tuple[int, str, str] | None:
        """Render ``payload``'s template into its subject, text and html, in place; or why
        not, as (status, error code, message). A payload without a template is left alone."""
        if not isinstance(payload, dict) or "template" not in payload:
            return None
        template = payload["template"]
        if not isinstance(template, dict):
            return 422, "invalid_request", "'template' must be an object"
        template_id, version = template.get("id"), template.get("version")
        variables = template.get("variables") or {}
        if not isinstance(template_id, str) or not isinstance(variables, dict):
            return 422, "invalid_request", "'template' needs an 'id' (string) and 'variables'"
        if template_id not in self.known():
            return 422, "template_not_found", f"template {template_id!r} does not exist"
        number = _version_number(version)
        if number is False:
            return 422, "invalid_request", f"template version {version!r} is not a version"
        try:
            rendered = self.renderer.render(template_id, number or None, variables)
        except TemplateRenderError as error:
            if error.code == "template_missing":
                return 422, "template_not_found", f"template {template_id!r}: {error}"
            return 422, "template_error", f"template {template_id!r}: {error}"
        payload.update(subject=rendered.subject, text=rendered.text, html=rendered.html)
        return None


def _version_number(version: Any) -> int | bool | None:
    """None for the live version, the number of an int or a tag (``v3``), False otherwise."""
    if version is None:
        return None
    if isinstance(version, int) and not isinstance(version, bool) and version > 0:
        return version
    if isinstance(version, str) and (match := _TAGGED.fullmatch(version)):
        return int(match.group(1))
    return False
