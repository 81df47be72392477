"""How long to wait before a message's next attempt: a pure strategy, no Dagster.

Both the send op (through ``RetryRequested``) and the lane worker (holding its claim) wait this
long. The formula is Dagster's ``RetryPolicy(backoff=EXPONENTIAL, jitter=FULL)``: before retry
*k* (``retry_number`` k - 1) it waits ``random() * (2**k - 1) * retry_delay_s``. Dagster's has
no ceiling, so the lane's ``max_retry_delay_s`` caps it, and a provider's ``Retry-After`` too.
"""

import random
from collections.abc import Callable

from email_platform.common.lanes import LaneConfig


def backoff_ceiling_s(lane: LaneConfig, retry_number: int) -> float:
    """The longest full-jitter wait before retry ``retry_number + 1``, before the lane's cap."""
    return (2 ** (retry_number + 1) - 1) * lane.retry_delay_s


def retry_wait_s(
    lane: LaneConfig,
    retry_number: int,
    retry_after_s: float | None,
    *,
    draw: Callable[[], float] = random.random,
) -> float:
    """The provider's Retry-After when it gave one, else exponential backoff with full jitter.

    ``retry_number`` counts the retries already made (0 before the first). ``draw`` is the
    jitter's uniform draw in [0, 1).
    """
    if retry_after_s is not None:
        return min(retry_after_s, lane.max_retry_delay_s)
    return min(draw() * backoff_ceiling_s(lane, retry_number), lane.max_retry_delay_s)
