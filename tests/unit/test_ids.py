"""Unit tests of ULID event ids: shape, validation, time order and uniqueness.

An event id is 26 Crockford base32 characters: 48 bits of milliseconds then 80 random bits.
Ids made at later milliseconds must sort later as plain strings (the outbox reads oldest-first
by id), and ids made in the same millisecond must still never collide.
"""

import random
import time

import pytest

from email_platform.common.ids import is_ulid, new_ulid

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def _timestamp_of(ulid: str) -> int:
    value = 0
    for char in ulid[:10]:
        value = value * 32 + CROCKFORD.index(char)
    return value


def test_shape() -> None:
    for _ in range(200):
        ulid = new_ulid()
        assert len(ulid) == 26
        assert set(ulid) <= set(CROCKFORD)
        assert not set(ulid) & set("ILOU")
        assert ulid[0] <= "7"  # 128 bits in 130: the top two bits are zero


def test_timestamp_prefix_encodes_the_given_milliseconds() -> None:
    assert new_ulid(0).startswith("0000000000")
    assert new_ulid(1).startswith("0000000001")
    assert new_ulid(32).startswith("0000000010")
    assert new_ulid(2**48 - 1).startswith("7ZZZZZZZZZ")
    assert _timestamp_of(new_ulid(1_700_000_000_123)) == 1_700_000_000_123


def test_default_timestamp_is_now() -> None:
    before = int(time.time() * 1000)
    ulid = new_ulid()
    after = int(time.time() * 1000)
    assert before <= _timestamp_of(ulid) <= after


def test_random_part_varies_within_one_millisecond() -> None:
    ids = [new_ulid(1_700_000_000_000) for _ in range(50)]
    assert len({i[:10] for i in ids}) == 1
    assert len({i[10:] for i in ids}) == 50


def test_is_ulid_accepts_generated_ids_in_either_case() -> None:
    ulid = new_ulid()
    assert is_ulid(ulid)
    assert is_ulid(ulid.lower())


@pytest.mark.parametrize(
    "value",
    [
        "",
        "0" * 25,
        "0" * 27,
        "01J" + "U" * 23,  # U is not Crockford
        "01J" + "I" * 23,
        "01J" + "L" * 23,
        "01J" + "O" * 23,
        "01J-" + "0" * 22,
        "01J " + "0" * 22,
        "user_abc123",
    ],
)
def test_is_ulid_rejects(value: str) -> None:
    assert not is_ulid(value)


def test_ids_sort_in_time_order() -> None:
    stamps = [0, 1, 31, 32, 999, 1_000, 1_700_000_000_000, 1_700_000_000_001, 2**48 - 1]
    ids = [new_ulid(ms) for ms in stamps for _ in range(5)]
    shuffled = ids[:]
    random.Random(3).shuffle(shuffled)
    ordered = sorted(shuffled)
    assert [_timestamp_of(i) for i in ordered] == sorted(_timestamp_of(i) for i in ids)
    assert [_timestamp_of(i) for i in ordered] == [ms for ms in stamps for _ in range(5)]


def test_consecutive_milliseconds_sort_in_order() -> None:
    start = 1_700_000_000_000
    ids = [new_ulid(start + i) for i in range(2_000)]
    assert ids == sorted(ids)


def test_ten_thousand_ids_are_unique() -> None:
    assert len({new_ulid() for _ in range(10_000)}) == 10_000
    assert len({new_ulid(1_700_000_000_000) for _ in range(10_000)}) == 10_000
