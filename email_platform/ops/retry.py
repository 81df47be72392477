"""The one step-level retry policy of every op.

It catches what is not a provider outcome (a dropped database connection, a crash in our own
code): the retry claims again what the attempt held and re-sends only what is still pending.
Provider outcomes are retried by the ops themselves (``email_platform.sending.retry``).
"""

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import (
    Backoff,
    DagsterError,
    Failure,
    Jitter,
    OpExecutionContext,
    RetryPolicy,
    RetryRequested,
)

from email_platform.common.errors import ConfigurationError

STEP_RETRY_POLICY = RetryPolicy(
    max_retries=3, delay=2.0, backoff=Backoff.EXPONENTIAL, jitter=Jitter.FULL
)


@contextmanager
def retried_on_error(
    context: OpExecutionContext, policy: RetryPolicy = STEP_RETRY_POLICY
) -> Iterator[None]:
    """``policy`` applied by the op itself, for ops run by the in-process executor.

    Given to ``@op(retry_policy=...)``, Dagster 1.13 also retries an interrupted step
    (``op_execution_error_boundary``): a step running in its run's own process would turn an
    operator's terminate into a retry and keep sending. Raised from here, an exception is
    retried and an interrupt (a ``BaseException``) ends the step.
    """
    try:
        yield
    # A setting that is wrong now is wrong on the retry too: fail at once, naming it.
    except (DagsterError, Failure, RetryRequested, ConfigurationError):
        raise
    except Exception as error:
        if context.retry_number >= policy.max_retries:
            raise
        raise RetryRequested(
            max_retries=policy.max_retries,
            seconds_to_wait=policy.calculate_delay(context.retry_number + 1),
        ) from error
