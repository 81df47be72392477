"""email_platform: event-driven transactional email on Dagster."""

from email_platform.common.errors import (
    EventRefusedError,
    HeaderInjectionError,
    InvalidAddressError,
    InvalidIdempotencyKeyError,
    InvalidPayloadError,
    PayloadSchemaError,
    PublishError,
    RateLimitedError,
    UndeclaredEventError,
    UnknownPriorityError,
)
from email_platform.mail.addressing import Attachment, Mailbox
from email_platform.mail.locales import InvalidLocaleError
from email_platform.mail.provider_templates import ProviderTemplate
from email_platform.mail.routes import Route, RouteTable
from email_platform.publishing.cancelling import CancelResult, CancelStatus, cancel
from email_platform.publishing.outcomes import Outcome, OutcomePage, read_outcomes
from email_platform.publishing.publisher import publish, publish_many

__all__ = [
    "Attachment",
    "CancelResult",
    "CancelStatus",
    "EventRefusedError",
    "HeaderInjectionError",
    "InvalidAddressError",
    "InvalidIdempotencyKeyError",
    "InvalidLocaleError",
    "InvalidPayloadError",
    "Mailbox",
    "Outcome",
    "OutcomePage",
    "PayloadSchemaError",
    "ProviderTemplate",
    "PublishError",
    "RateLimitedError",
    "Route",
    "RouteTable",
    "UndeclaredEventError",
    "UnknownPriorityError",
    "cancel",
    "publish",
    "publish_many",
    "read_outcomes",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The Dagster Component loads on first use: publish() needs no Dagster.
    if name == "EmailPlatformComponent":
        from email_platform.component import EmailPlatformComponent

        return EmailPlatformComponent
    raise AttributeError(f"module 'email_platform' has no attribute {name!r}")


def __dir__() -> list[str]:
    # Listed, so `dg list components` finds the Component in this package's entry point.
    return [*globals(), "EmailPlatformComponent"]
