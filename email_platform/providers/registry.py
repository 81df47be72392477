"""Provider name -> adapter class. Imported lazily: a deployment loads only its own adapter."""

import importlib

from email_platform.common.config import PROVIDERS, ProviderSettings
from email_platform.common.errors import ConfigurationError
from email_platform.providers.base import EmailProvider
from email_platform.providers.failover import FailoverProvider, FailoverState

#: The adapter class in ``email_platform.providers.<name>`` of every name in ``PROVIDERS``.
_CLASSES = {
    "sandbox": "SandboxProvider",
    "postmark": "PostmarkProvider",
    "sendgrid": "SendGridProvider",
    "mailgun": "MailgunProvider",
    "ses": "SesProvider",
    "resend": "ResendProvider",
    "smtp": "SmtpProvider",
}
ADAPTERS: dict[str, str] = {
    name: f"email_platform.providers.{name}:{_CLASSES[name]}" for name in PROVIDERS
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


def open_failover(
    primary: ProviderSettings,
    secondary: ProviderSettings | None,
    state: FailoverState,
    *,
    max_connections: int,
) -> FailoverProvider:
    """The primary's adapter behind ``state``'s circuit breaker, and the secondary's (if any)
    to take over while it is open."""
    first = open_provider(primary, max_connections=max_connections)
    try:
        second = open_provider(secondary, max_connections=max_connections) if secondary else None
    except BaseException:
        first.close()
        raise
    return FailoverProvider(first, second, state)
