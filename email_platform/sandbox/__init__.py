"""The sandbox provider: a real HTTP server on loopback that the demo, tests and benchmarks
send to, with injected faults and signed webhooks. A harness, not part of the send path: the
adapter that talks to it is ``email_platform.providers.sandbox``.
"""
