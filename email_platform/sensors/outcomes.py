"""The outcome sensor: provider outcomes handed to the product's callback, at least once.

The callback is ``EMAIL_PLATFORM_OUTCOME_HANDLER`` (``"package.module:NAME"``) or the one given
to ``build_definitions(outcome_handler=...)``. The sensor cursor is the feed's cursor
(``publishing.outcomes.read_outcomes``) and moves only past pages the callback returned from:
a callback that raises fails the tick with its error, and the next tick offers the same
outcomes again (with the same ``outcome_id``s).
"""

from dagster import (
    DefaultSensorStatus,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from email_platform.common import config
from email_platform.common.errors import EmailPlatformError
from email_platform.publishing.outcomes import OutcomeHandler, load_handler, read_outcomes
from email_platform.resources import AppDatabase

PAGE_SIZE = 500
#: Pages per tick: a backlog drains at up to this many callbacks per tick.
MAX_PAGES = 10
SENSOR_NAME = "email_outcomes_sensor"


class OutcomeHandlerError(EmailPlatformError):
    """The product's outcome callback raised: the tick fails, the outcomes come again."""


def make_outcomes_sensor(handler: OutcomeHandler | str | None = None) -> SensorDefinition:
    """The sensor, calling ``handler`` (a callable, or ``"package.module:NAME"``; None: the
    ``EMAIL_PLATFORM_OUTCOME_HANDLER`` setting, read at each tick)."""

    @sensor(
        name=SENSOR_NAME,
        minimum_interval_seconds=10,
        default_status=DefaultSensorStatus.RUNNING,
        description=(
            "Hands provider outcomes (delivered, bounced, complained, unsubscribed) to the "
            f"product's callback ({config.OUTCOME_HANDLER_SETTING}), at least once; the "
            "cursor moves only after the callback returned."
        ),
    )
    def email_outcomes_sensor(
        context: SensorEvaluationContext, email_database: AppDatabase
    ) -> SkipReason:
        spec = handler if handler is not None else config.outcome_handler_spec()
        if spec is None:
            return SkipReason(f"No outcome handler: set {config.OUTCOME_HANDLER_SETTING}.")
        call = load_handler(spec) if isinstance(spec, str) else spec
        cursor = int(context.cursor or 0)
        handed = 0
        for _ in range(MAX_PAGES):
            with email_database.get_engine().connect() as connection:
                page = read_outcomes(connection, after=cursor, limit=PAGE_SIZE)
            if page.outcomes:
                try:
                    call(page.outcomes)
                except Exception as exc:
                    raise OutcomeHandlerError(
                        f"the outcome handler raised on {len(page.outcomes)} outcome(s) after "
                        f"cursor {cursor} (offered again next tick): {exc!r}"
                    ) from exc
                handed += len(page.outcomes)
            if page.cursor != cursor:
                cursor = page.cursor
                context.update_cursor(str(cursor))
            if len(page.outcomes) < PAGE_SIZE:
                break
        return SkipReason(f"Handed {handed} outcome(s) to the handler; cursor at {cursor}.")

    return email_outcomes_sensor
