"""The engines' JSON decoder reads every document as ``json.loads`` does (orjson where the two
agree): integers past 64 bits, ``NaN``, lone surrogates and huge exponents included."""

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from email_platform.db.engine import json_loads

_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | st.text(alphabet=st.characters(codec=None), max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@given(_VALUES, st.booleans(), st.booleans())
@settings(max_examples=1000, deadline=None)
def test_the_decoder_reads_what_json_loads_reads(value: object, ascii_only: bool, as_bytes: bool):
    document = json.dumps(value, ensure_ascii=ascii_only)
    expected = json.loads(document)
    raw = document.encode("utf-8", "surrogatepass") if as_bytes else document
    if as_bytes and not ascii_only and any(0xD800 <= ord(c) <= 0xDFFF for c in document):
        return  # not UTF-8: no database hands these bytes over
    assert _same(json_loads(raw), expected)


def test_what_orjson_alone_reads_differently_is_read_as_json_loads_reads_it():
    for document in ["123456789012345678901234567890", "[NaN, Infinity]", '"\\ud800"', "1e400"]:
        for raw in (document, document.encode()):
            assert _same(json_loads(raw), json.loads(document)), document
