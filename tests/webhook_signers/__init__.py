"""One ``Signer`` per webhook provider, for the shared suite and each provider's own module."""

from tests.webhook_signers.mailgun import SIGNER as MAILGUN
from tests.webhook_signers.postmark import SIGNER as POSTMARK
from tests.webhook_signers.resend import SIGNER as RESEND
from tests.webhook_signers.sandbox import SIGNER as SANDBOX
from tests.webhook_signers.sendgrid import SIGNER as SENDGRID
from tests.webhook_signers.ses import SIGNER as SES

SIGNERS = (SANDBOX, POSTMARK, SENDGRID, MAILGUN, RESEND, SES)
#: The providers with documented fixtures (the sandbox's events are built, not recorded).
WITH_FIXTURES = tuple(signer for signer in SIGNERS if signer.fixtures is not None)
