"""email_platform: event-driven transactional email on Dagster."""

from email_platform.errors import (
    EventRefusedError,
    HeaderInjectionError,
    InvalidAddressError,
    InvalidPayloadError,
    PublishError,
    RateLimitedError,
    UnknownPriorityError,
)
from email_platform.publisher import publish, publish_many

__all__ = [
    "EventRefusedError",
    "HeaderInjectionError",
    "InvalidAddressError",
    "InvalidPayloadError",
    "PublishError",
    "RateLimitedError",
    "UnknownPriorityError",
    "publish",
    "publish_many",
]
__version__ = "0.1.0"
