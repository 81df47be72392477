"""What mail an event causes and what it looks like, for the producer and the worker alike.

- ``routes``: the route table (event type -> mails, lane, guards) and upcasters.
- ``rendering``: versioned Jinja2 templates, strict, cached.
- ``recipients``: resolvers that look an address up at send time.
- ``unsubscribe``: signed one-click links and bulk mail's headers (RFC 8058).
- ``headers``: what may reach a mail header (no line break).
"""
