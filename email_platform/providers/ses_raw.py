"""SES's Reply-To, Cc, Bcc and attachments (``mail/addressing.py``).

Without attachments the ``Simple`` content stays: Cc and Bcc go in ``Destination``
(``CcAddresses``, ``BccAddresses``) and Reply-To in ``ReplyToAddresses``, as the SES v2
``SendEmail`` model names them. With attachments the content is ``Raw``: a MIME message
(``multipart/mixed``: the text and HTML alternative, then each file in base64) written by the
SMTP adapter's writer (``smtp_message.py``) in 7-bit form, since SES does not take SMTPUTF8;
``Destination`` still names every recipient, so Bcc reaches its address without a header.
"""

import base64
from collections.abc import Callable
from email.utils import parseaddr
from typing import Any

from email_platform.common.errors import PermanentError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.smtp_message import LINE_SHOULD, SmtpMessage, address_list, phrase


def destination(email: OutgoingEmail, address: Callable[[str, str], str]) -> dict[str, Any]:
    """``Destination`` with the Cc and Bcc addresses, in SES's 7-bit form (``address``)."""
    found: dict[str, Any] = {"ToAddresses": [address(email.to, "to")]}
    if email.cc:
        found["CcAddresses"] = [address(value, "cc") for value in email.cc]
    if email.bcc:
        found["BccAddresses"] = [address(value, "bcc") for value in email.bcc]
    return found


def reply_to(email: OutgoingEmail, address: Callable[[str, str], str]) -> dict[str, Any]:
    if not email.reply_to:
        return {}
    return {"ReplyToAddresses": [address(value, "reply_to") for value in email.reply_to]}


def raw_content(
    email: OutgoingEmail, headers: list[dict[str, str]], ascii_address: Callable[[str, str], str]
) -> dict[str, Any]:
    """``{"Raw": {"Data": base64}}``: the whole message, headers (``headers``: the SES-checked
    custom and ``X-Email-*`` ones) and attachments included."""

    def entry(value: str, role: str) -> tuple[str, str]:
        name, addr = parseaddr(value)
        return name, ascii_address(addr, role)

    sender_name, sender = entry(email.sender, "sender")
    to = ascii_address(parseaddr(email.to)[1] or email.to, "to")
    message = SmtpMessage(sender, to, email.text, email.html)
    message.attachments = email.attachments
    if sender_name:
        shown = phrase(sender_name, LINE_SHOULD - len("From: "))
        message.add_raw("From", email.sender, f"From: {shown} <{sender}>\r\n")
    else:
        message.add_raw("From", sender, f"From: {sender}\r\n")
    message.add_raw("To", to, f"To: {to}\r\n")
    for name, role, values in (("Cc", "cc", email.cc), ("Reply-To", "reply_to", email.reply_to)):
        if values:
            message.add_raw(name, *address_list(name, [entry(v, role) for v in values]))
    message.add("Subject", email.subject)
    for header in headers:
        message.add(header["Name"], header["Value"])
    try:
        data = message.as_bytes(eight_bit=False)
    except (UnicodeError, ValueError) as exc:  # text no UTF-8 can carry (a lone surrogate)
        raise PermanentError(
            f"the message cannot be serialized: {exc}", code="unencodable_text"
        ) from exc
    return {"Raw": {"Data": base64.b64encode(data).decode("ascii")}}
