"""The full build's memory bound: one setting, read when asked for, refused with its name when
it is no size DuckDB understands."""

import pytest

from email_platform.common import config
from email_platform.resources import Warehouse


def test_the_memory_bound_defaults_to_2gb_and_takes_a_size_from_the_environment():
    assert config.warehouse_memory({}) == "2GB"
    assert config.warehouse_memory({"EMAIL_PLATFORM_WAREHOUSE_MEMORY": " 512MiB "}) == "512MiB"
    assert Warehouse(memory_limit="3GB").resolved_memory_limit() == "3GB"
    # The bounds themselves are taken.
    assert config.warehouse_memory({"EMAIL_PLATFORM_WAREHOUSE_MEMORY": "64MB"}) == "64MB"
    assert config.checked_memory("1000TB", "memory_limit") == "1000TB"


@pytest.mark.parametrize(
    "value",
    [
        "",
        "2",
        "lots",
        "2GB; DROP TABLE x",
        "-1GB",
        # Sizes DuckDB parses but every query then fails out of memory, not naming the setting,
        # or one it cannot parse at all.
        "0GB",
        "1B",
        "10KB",
        "63MB",
        "99999999999999999999TB",
    ],
)
def test_a_memory_bound_that_is_no_size_is_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match="EMAIL_PLATFORM_WAREHOUSE_MEMORY"):
        config.warehouse_memory({"EMAIL_PLATFORM_WAREHOUSE_MEMORY": value})
    with pytest.raises(ValueError, match="memory_limit"):
        Warehouse(memory_limit=value).resolved_memory_limit()
