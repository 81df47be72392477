"""The SMTP adapter's header writer (providers/smtp_message.py) on any text: encoded words decode
to exactly the text, ASCII values unfold to exactly themselves, lines stay within RFC 5322's
limits. (The wire, through a real Postfix, is tests/integration/test_smtp_postfix.py.)"""

import re
from email import message_from_bytes
from email import policy as email_policy
from email.header import decode_header, make_header

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from email_platform.common.errors import PermanentError
from email_platform.providers.smtp_message import (
    LINE_MUST,
    LINE_SHOULD,
    fold,
    unstructured,
    wire_address,
)

# Text a header may hold (header_problem refuses control characters and line separators).
_TEXT = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"), blacklist_characters="\x85"),
    min_size=1,
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(_TEXT.filter(lambda text: not text.isascii()))
def test_non_ascii_text_decodes_to_exactly_itself(text: str) -> None:
    line = unstructured("Subject", text)
    assert line.isascii()
    lines = line.split("\r\n")[:-1]
    assert all(len(each) <= LINE_SHOULD for each in lines), lines
    value = line[len("Subject: ") :].replace("\r\n", "")
    assert str(make_header(decode_header(value))) == text
    parsed = message_from_bytes(line.encode() + b"\r\n", policy=email_policy.default)
    assert str(parsed["Subject"]) == text


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E) | st.just("\t"), max_size=400))
def test_ascii_values_are_folded_at_whitespace_only(text: str) -> None:
    line = fold("List-Unsubscribe", text)
    assert line is not None
    lines = line.split("\r\n")[:-1]
    # Unfolding (removing each CRLF) gives back the value, byte for byte.
    assert "".join(lines) == f"List-Unsubscribe: {text}"
    assert all(each[:1] in (" ", "\t") and each.strip() for each in lines[1:])
    for index, each in enumerate(lines):
        words = re.findall(
            r"[ \t]*[^ \t]+", each[len("List-Unsubscribe: ") :] if index == 0 else each
        )
        # Over 78 characters only where one word alone is: nowhere to fold.
        assert len(each) <= LINE_SHOULD or len(words) <= 1, lines
    assert fold("X-Long", "x" * LINE_MUST) is None


@pytest.mark.parametrize(
    ("address", "wire", "needs_smtputf8"),
    [
        ("jane@example.com", "jane@example.com", False),
        ("jane@bücher.example.com", "jane@xn--bcher-kva.example.com", False),
        ("jösé@bücher.example.com", "jösé@xn--bcher-kva.example.com", True),
        ('"john doe"@example.com', '"john doe"@example.com', False),
    ],
)
def test_addresses_go_out_with_a_label_domains(
    address: str, wire: str, needs_smtputf8: bool
) -> None:
    spec, utf8 = wire_address(address, "recipient")
    assert spec == wire
    assert (utf8 is not None) == needs_smtputf8


@pytest.mark.parametrize(
    "address",
    ["Jane <jane@example.com>", "a@b@c", "jane@", "jö sé@example.com", "jane@xn--.ü.example"],
)
def test_an_unusable_address_is_a_named_permanent_error(address: str) -> None:
    with pytest.raises(PermanentError) as refused:
        wire_address(address, "recipient")
    assert refused.value.code == "invalid_address" and address in str(refused.value)
