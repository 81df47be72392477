"""Provider name -> how its webhooks are verified and normalized."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from email_platform import config
from email_platform.errors import ConfigurationError
from email_platform.webhooks import sandbox
from email_platform.webhooks.standard import StandardWebhooksVerifier
from email_platform.webhooks.vocabulary import NormalizedEvent


class Verifier(Protocol):
    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> str | None:
        """The provider's delivery id of an authentic webhook; raises ``WebhookRejected``."""
        ...


@dataclass(frozen=True)
class WebhookProvider:
    name: str
    verifier: Callable[[Mapping[str, str]], Verifier]
    normalize: Callable[[bytes], list[NormalizedEvent]]


def _standard(secret_var: str) -> Callable[[Mapping[str, str]], Verifier]:
    def build(settings: Mapping[str, str]) -> Verifier:
        secret = settings.get(secret_var)
        if not secret:
            raise ConfigurationError(f"{config.PREFIX}{secret_var.upper()} is not set")
        return StandardWebhooksVerifier(secret)

    return build


PROVIDERS: dict[str, WebhookProvider] = {
    "sandbox": WebhookProvider("sandbox", _standard("sandbox_webhook_secret"), sandbox.normalize),
}


def get(name: str) -> WebhookProvider:
    try:
        return PROVIDERS[name]
    except KeyError:
        raise ConfigurationError(f"no webhook support for provider {name!r}") from None
