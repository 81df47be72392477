"""``email-platform retention``: purge what is older than the retention settings."""

import click


@click.group()
def retention() -> None:
    """Purge operational history past its retention."""
