"""The project's error tree.

``PublishError`` subclasses are what a producer can fix (they are ``ValueError``s and name the
field). ``ProviderError`` subclasses are what a send can hit: transient ones are retried,
permanent ones go straight to the dead-letter table. ``ConfigurationError`` is apart on purpose:
a wrong setting is never dead-lettered and never swallowed, it fails loudly.
"""


class EmailPlatformError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigurationError(EmailPlatformError):
    """A setting is missing or wrong; fix the deployment, not the message."""


class PublishError(EmailPlatformError, ValueError):
    """``publish()`` was called with something the caller must fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def with_field(self, field: str) -> "PublishError":
        """The same error (class and attributes) naming ``field`` instead: ``publish_many``
        says which event, ``events[3].payload.order_id``."""
        renamed = type(self).__new__(type(self))
        renamed.__dict__.update(self.__dict__)
        PublishError.__init__(renamed, field, self.message)
        return renamed


class InvalidAddressError(PublishError):
    """An email address is not syntactically valid."""


class HeaderInjectionError(PublishError):
    """A value that ends up in a mail header contains CR or LF."""


class InvalidIdempotencyKeyError(PublishError):
    """An idempotency key some adapter cannot carry as it is (it travels in HTTP and mail
    headers): see ``validation.check_idempotency_key`` for the rule."""


class InvalidPayloadError(PublishError):
    """The payload is not a JSON object, is too large, or misses a required field."""


class PayloadSchemaError(InvalidPayloadError):
    """The payload does not match the JSON Schema declared for its event type and version;
    ``field`` names the value (``payload.order_id``), ``rule`` the schema keyword it breaks."""

    def __init__(
        self, field: str, message: str, *, event_type: str, event_version: int, rule: str
    ) -> None:
        super().__init__(field, message)
        self.event_type = event_type
        self.event_version = event_version
        self.rule = rule


class UndeclaredEventError(PublishError):
    """The route table declares schemas, but none for this event type and version."""

    def __init__(self, field: str, message: str, *, declared_versions: tuple[int, ...]) -> None:
        super().__init__(field, message)
        self.declared_versions = declared_versions


class UnknownPriorityError(PublishError):
    """The priority is not one of the lanes."""


class RateLimitedError(PublishError):
    """A route's rate limit is reached for this key: try again after ``retry_after_s``."""

    def __init__(self, field: str, message: str, *, route: str, retry_after_s: float) -> None:
        super().__init__(field, message)
        self.route = route
        self.retry_after_s = retry_after_s


class EventRefusedError(PublishError):
    """A route's authorization hook refused the event."""

    def __init__(self, field: str, message: str, *, route: str) -> None:
        super().__init__(field, message)
        self.route = route


class NotInTransactionError(EmailPlatformError):
    """``publish()`` must run inside the caller's transaction, never its own."""


class DeliveryError(EmailPlatformError):
    """A message could not be handed to the provider."""

    #: Short machine-readable reason stored on the dead letter.
    reason: str = "delivery_failed"

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code


class BatchNotSentError(EmailPlatformError):
    """A batch call that sent nothing and that one message may have caused: the provider
    refused the request whole as invalid (400, 413, 422), or its body could not be built.
    The dispatcher then sends the messages one a call, so only the one at fault fails
    (invariant 9). Any other failure of a batch call may follow an acceptance, so it is each
    message's own result, never a reason to send again (invariant 3). ``error`` is what a
    message alone gets."""

    def __init__(self, error: DeliveryError) -> None:
        super().__init__(str(error))
        self.error = error


class TransientError(DeliveryError):
    """Worth retrying: network errors, timeouts, 429 and 5xx."""

    reason = "transient"

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, status_code=status_code, code=code)
        self.retry_after_s = retry_after_s


class PermanentError(DeliveryError):
    """Never worth retrying as is: the message goes to the dead-letter table."""

    reason = "permanent_failure"


class ProviderRejectedError(PermanentError):
    """The provider refused the message (4xx other than 429)."""

    reason = "provider_rejected"


class TemplateRenderError(PermanentError):
    reason = "template_error"


class UnknownEventVersionError(PermanentError):
    reason = "unknown_event_version"


class RecipientNotFoundError(PermanentError):
    reason = "recipient_not_found"


class InvalidRecipientError(PermanentError):
    """The address a message would go to is one mail systems refuse (read at send time)."""

    reason = "invalid_recipient"


class UnstorableEventError(PermanentError):
    """The database refused what this event's processing wrote; only this event is failed."""

    reason = "unstorable"
