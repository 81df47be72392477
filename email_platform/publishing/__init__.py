"""The producer's side: ``publish()`` and ``publish_many()`` in the caller's transaction.

- ``publisher``: the two calls, the outbox row they write.
- ``validation``: what a producer can fix, refused at once with a ``PublishError``.
- ``guards``: idempotency keys, each route's rate limit and authorization hook.
"""
