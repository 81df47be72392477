"""The benchmarks. They publish and send the demo's events, so they choose the demo's route
table (``EMAIL_PLATFORM_ROUTES``) for themselves and every process they start: a deployment
names its own, and nothing falls back to the demo's."""

import os

from email_platform.common.config import ROUTES_SETTING
from email_platform.mail.routes import DEMO_ROUTES

os.environ[ROUTES_SETTING] = DEMO_ROUTES
