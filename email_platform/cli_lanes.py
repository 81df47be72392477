"""``email-platform lanes``: pause, resume and inspect the priority lanes."""

import click


@click.group()
def lanes() -> None:
    """Pause, resume and inspect the priority lanes."""
