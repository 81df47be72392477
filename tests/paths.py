"""Where the tests find the repository's files, wherever in ``tests/`` a test module lives."""

from pathlib import Path

#: The repository's root (``pyproject.toml``, ``email_platform/``, ``analytics/``, ``deploy/``).
ROOT = Path(__file__).resolve().parent.parent
#: The providers' webhook bodies the webhook tests replay.
WEBHOOK_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "webhooks"
