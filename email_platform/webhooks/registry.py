"""Provider name -> how its webhooks are verified and normalized.

Each provider module exposes ``build_verifier(settings) -> Verifier`` (``settings`` are the
``EMAIL_PLATFORM_*_WEBHOOK_*`` values, lower-cased without the prefix) and
``normalize(body: bytes) -> list[NormalizedEvent]``. Modules load on first use.
"""

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Protocol

from email_platform.common.config import WEBHOOK_PROVIDERS
from email_platform.common.errors import ConfigurationError
from email_platform.webhooks.vocabulary import NormalizedEvent

NAMES = WEBHOOK_PROVIDERS


class Verifier(Protocol):
    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> str | None:
        """The provider's delivery id of an authentic webhook; raises ``WebhookRejected``."""
        ...


@dataclass(frozen=True)
class WebhookProvider:
    name: str
    verifier: Callable[[Mapping[str, str]], Verifier]
    normalize: Callable[[bytes], list[NormalizedEvent]]


@cache
def get(name: str) -> WebhookProvider:
    if name not in NAMES:
        raise ConfigurationError(f"no webhook support for provider {name!r}")
    try:
        module = importlib.import_module(f"email_platform.webhooks.{name}")
    except Exception as exc:  # one broken provider module must not take the others down
        raise ConfigurationError(f"webhooks for {name!r} are not available: {exc}") from None
    return WebhookProvider(name, module.build_verifier, module.normalize)


def available() -> dict[str, WebhookProvider]:
    """Every provider whose webhook module loads."""
    found: dict[str, WebhookProvider] = {}
    for name in NAMES:
        try:
            found[name] = get(name)
        except ConfigurationError:
            continue
    return found
