"""Provider name -> adapter class. Imported lazily: a deployment loads only its own adapter."""

import importlib

from email_platform.config import ProviderSettings
from email_platform.errors import ConfigurationError
from email_platform.providers.base import EmailProvider

ADAPTERS: dict[str, str] = {
    "sandbox": "email_platform.providers.sandbox:SandboxProvider",
    "postmark": "email_platform.providers.postmark:PostmarkProvider",
    "sendgrid": "email_platform.providers.sendgrid:SendGridProvider",
    "mailgun": "email_platform.providers.mailgun:MailgunProvider",
    "ses": "email_platform.providers.ses:SesProvider",
    "resend": "email_platform.providers.resend:ResendProvider",
    "smtp": "email_platform.providers.smtp:SmtpProvider",
}


def open_provider(settings: ProviderSettings, *, max_connections: int) -> EmailProvider:
    """The adapter for ``settings.name``, with one keep-alive client sized for the run."""
    target = ADAPTERS.get(settings.name)
    if target is None:
        raise ConfigurationError(f"no adapter for provider {settings.name!r}")
    module_name, _, class_name = target.partition(":")
    try:
        adapter = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"provider {settings.name!r} is not available: {exc}") from None
    return adapter.from_settings(settings, max_connections=max_connections)
