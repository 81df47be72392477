"""The one step-level retry policy of every op.

It catches what is not a provider outcome (a dropped database connection, a step interrupted):
the retry claims again what the attempt held and re-sends only what is still pending. Provider
outcomes are retried by the ops themselves (``email_platform.sending.retry``).
"""

from dagster import Backoff, Jitter, RetryPolicy

STEP_RETRY_POLICY = RetryPolicy(
    max_retries=3, delay=2.0, backoff=Backoff.EXPONENTIAL, jitter=Jitter.FULL
)
