"""The producer's side: ``publish()`` and ``publish_many()`` in the caller's transaction, and
``cancel()`` to take an event back the same way.

- ``publisher``: the two calls, the outbox row they write.
- ``validation``: what a producer can fix, refused at once with a ``PublishError``.
- ``guards``: idempotency keys, each route's rate limit and authorization hook.
- ``cancelling``: ``cancel()`` and its typed ``CancelResult``.
- ``outcomes``: ``read_outcomes()``, the provider outcomes offered back to the product.
"""

from email_platform.publishing.cancelling import CancelResult, CancelStatus, cancel

__all__ = ["CancelResult", "CancelStatus", "cancel"]
