"""``email-platform metrics``: the Prometheus endpoint as a command of its own."""

import click


@click.group()
def metrics() -> None:
    """Prometheus metrics from the operational tables."""
