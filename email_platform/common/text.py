"""Text both databases can store: no NUL (PostgreSQL refuses it), nothing UTF-8 cannot encode.

``text_problem`` is the check ``publish()`` and the renderer apply to what a producer sent;
``storable_text`` is what the send path writes for text it did not choose (a provider's error
message or message id), so one odd answer cannot fail the transaction that records a batch.
"""


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text on both databases, or ``None``."""
    if "\x00" in value:
        return "contains NUL, which PostgreSQL text cannot hold"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"contains {value[exc.start]!r} at {exc.start}, which UTF-8 cannot encode"
    return None


def storable_text(value: str | None, max_length: int | None = None) -> str | None:
    """``value`` with NUL and unencodable characters replaced by U+FFFD, cut to ``max_length``."""
    if value is None:
        return None
    if text_problem(value) is not None:
        value = "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in value)
    if max_length is not None and len(value) > max_length:
        value = value[: max_length - 1] + "\u2026"
    return value
