"""Small local HTTP/SMTP servers that speak each provider's documented wire format.

Each stub records what it received and can be told to fail the next N requests, so the send
job is tested end to end against the provider's real request shape and error answers.
"""
