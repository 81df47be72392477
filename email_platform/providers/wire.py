"""Reply-To, Cc, Bcc and attachments as each HTTP API documents them (``mail/addressing.py``
says where they come from). Attachments travel base64-encoded in the JSON APIs and as multipart
files to Mailgun; SES and SMTP write MIME themselves (``ses_raw.py``, ``smtp_message.py``).

- Postmark (``/email``): ``Cc``, ``Bcc`` and ``ReplyTo`` as comma-separated strings,
  ``Attachments`` as ``[{"Name", "Content", "ContentType"}]``.
- SendGrid (``/v3/mail/send``): ``cc`` and ``bcc`` in the personalization, ``reply_to`` (one) or
  ``reply_to_list`` (several), ``attachments`` as ``[{"content", "type", "filename",
  "disposition"}]``. SendGrid refuses an address twice in one personalization, so an address
  already in To (or Cc) is left out of Cc (or Bcc): the recipient gets the message once either way.
- Mailgun (``/messages``): ``cc``, ``bcc`` and ``h:Reply-To`` form fields, each file an
  ``attachment`` part of a ``multipart/form-data`` request.
- Resend (``/emails``): ``cc``, ``bcc`` and ``reply_to`` as lists, ``attachments`` as
  ``[{"filename", "content", "content_type"}]``.
- The sandbox: all of them, and the envelope sender, recorded for tests to read back.
"""

import base64
from collections.abc import Callable
from email.utils import parseaddr
from typing import Any

from email_platform.providers.base import OutgoingEmail


def _b64(content: bytes) -> str:
    return base64.b64encode(content).decode("ascii")


def postmark_fields(email: OutgoingEmail) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, values in (("Cc", email.cc), ("Bcc", email.bcc), ("ReplyTo", email.reply_to)):
        if values:
            fields[name] = ", ".join(values)
    if email.attachments:
        fields["Attachments"] = [
            {"Name": a.filename, "Content": _b64(a.content), "ContentType": a.content_type}
            for a in email.attachments
        ]
    return fields


def sendgrid_fields(
    email: OutgoingEmail, body: dict[str, Any], address: Callable[[str], dict[str, str]]
) -> None:
    """Adds to ``body`` (its personalization holds ``to`` already)."""
    personalization = body["personalizations"][0]
    seen = {parseaddr(email.to)[1].lower()}
    for role, values in (("cc", email.cc), ("bcc", email.bcc)):
        unique = []
        for value in values:
            key = parseaddr(value)[1].lower()
            if key not in seen:
                seen.add(key)
                unique.append(address(value))
        if unique:
            personalization[role] = unique
    if len(email.reply_to) == 1:
        body["reply_to"] = address(email.reply_to[0])
    elif email.reply_to:
        body["reply_to_list"] = [address(value) for value in email.reply_to]
    if email.attachments:
        body["attachments"] = [
            {
                "content": _b64(a.content),
                "type": a.content_type,
                "filename": a.filename,
                "disposition": "attachment",
            }
            for a in email.attachments
        ]


def mailgun_fields(email: OutgoingEmail) -> dict[str, str]:
    fields = {}
    for name, values in (("cc", email.cc), ("bcc", email.bcc), ("h:Reply-To", email.reply_to)):
        if values:
            fields[name] = ", ".join(values)
    return fields


def mailgun_files(email: OutgoingEmail) -> list[tuple[str, tuple[str, bytes, str]]] | None:
    """Each attachment as an ``attachment`` part; None without any (the form stays urlencoded)."""
    if not email.attachments:
        return None
    return [("attachment", (a.filename, a.content, a.content_type)) for a in email.attachments]


def resend_fields(email: OutgoingEmail) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, values in (("cc", email.cc), ("bcc", email.bcc), ("reply_to", email.reply_to)):
        if values:
            fields[name] = list(values)
    if email.attachments:
        fields["attachments"] = [
            {"filename": a.filename, "content": _b64(a.content), "content_type": a.content_type}
            for a in email.attachments
        ]
    return fields


def sandbox_fields(email: OutgoingEmail) -> dict[str, Any]:
    fields: dict[str, Any] = {
        name: list(values)
        for name, values in (("reply_to", email.reply_to), ("cc", email.cc), ("bcc", email.bcc))
        if values
    }
    if email.envelope_sender:
        fields["envelope_sender"] = email.envelope_sender
    if email.attachments:
        fields["attachments"] = [
            {"filename": a.filename, "content_type": a.content_type, "content": _b64(a.content)}
            for a in email.attachments
        ]
    return fields
