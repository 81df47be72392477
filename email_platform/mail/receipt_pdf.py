"""The demo receipt's PDF, made at send time from the order in the payload.

A one-page PDF 1.4 written by hand (a catalog, a page, Helvetica, one content stream and the
cross-reference table with exact byte offsets): enough for any reader, and no dependency for a
demo. Text outside Latin-1's printable ASCII is shown as ``?`` (the standard font's encoding).
"""

from collections.abc import Mapping
from typing import Any

from email_platform.mail.addressing import Attachment

#: Lines on the page at most (a longer order says how many more items it has).
_MAX_LINES = 40


def _pdf_text(value: Any) -> str:
    text = "".join(c if " " <= c <= "~" else "?" for c in str(value))[:90]
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _lines(payload: Mapping[str, Any]) -> list[str]:
    lines = [f"Receipt for order {payload.get('order_id', '')}", ""]
    items = payload.get("items")
    items = items if isinstance(items, list) else []
    currency = payload.get("currency") or ""
    for item in items[: _MAX_LINES - 5]:
        if isinstance(item, Mapping):
            lines.append(
                f"{item.get('quantity', '')} x {item.get('name', '')} at "
                f"{item.get('unit_price', '')} {currency}"
            )
    if len(items) > _MAX_LINES - 5:
        lines.append(f"... and {len(items) - (_MAX_LINES - 5)} more items")
    lines += ["", f"Total: {payload.get('total', '')} {currency}"]
    return lines


def pdf_bytes(lines: list[str]) -> bytes:
    """A valid one-page PDF showing ``lines``."""
    text = "BT /F1 12 Tf 14 TL 72 770 Td " + " ".join(f"({_pdf_text(x)}) '" for x in lines) + " ET"
    stream = text.encode("latin-1")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
    ]
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def receipt_attachments(payload: Mapping[str, Any]) -> list[Attachment]:
    """The receipt route's attachment function: ``receipt-<order id>.pdf``."""
    return [
        Attachment(
            filename=f"receipt-{payload.get('order_id', 'order')}.pdf",
            content_type="application/pdf",
            content=pdf_bytes(_lines(payload)),
        )
    ]
