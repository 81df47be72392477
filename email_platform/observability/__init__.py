"""What the platform tells about itself.

- ``logs``: JSON log lines that carry ``event_id``; ``redaction``: no address in them.
- ``tracing``: optional OpenTelemetry spans continuing the publisher's trace.
- ``metrics``: Prometheus metrics read from the operational tables at scrape time.
"""
