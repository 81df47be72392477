"""``python -m email_platform.cli``, as the console script."""

from email_platform.cli import run

run()
