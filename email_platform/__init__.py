"""email_platform: event-driven transactional email on Dagster."""

from email_platform.errors import (
    HeaderInjectionError,
    InvalidAddressError,
    InvalidPayloadError,
    PublishError,
    UnknownPriorityError,
)
from email_platform.publisher import publish, publish_many

__all__ = [
    "HeaderInjectionError",
    "InvalidAddressError",
    "InvalidPayloadError",
    "PublishError",
    "UnknownPriorityError",
    "publish",
    "publish_many",
]
__version__ = "0.1.0"
