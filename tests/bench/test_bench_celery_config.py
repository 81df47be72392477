"""The bench's Celery configurations (``--celery-instant``, ``--celery-latency``): a spec is
either a deployment the bench can start, within bounds, or a ValueError naming the spec."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.baseline_celery import POOL_MAX, PREFORK_MAX, PROCESSES_MAX, CeleryConfig


@pytest.mark.parametrize(
    ("spec", "name", "in_flight"),
    [
        ("prefork-4", "prefork-4", 4),
        ("gevent-2x150", "gevent-2x150", 300),
        (" prefork-2@rabbitmq ", "prefork-2@rabbitmq", 2),
        ("threads-32@redis", "threads-32", 32),
    ],
)
def test_a_spec_names_the_deployment_it_parses_to(spec: str, name: str, in_flight: int) -> None:
    config = CeleryConfig.parse(spec)
    assert (config.name, config.in_flight) == (name, in_flight)
    assert CeleryConfig.parse(config.name) == config


@pytest.mark.parametrize(
    "spec",
    [
        "gevent-0",
        "prefork-0x4",
        f"prefork-{PREFORK_MAX + 1}",
        f"gevent-{POOL_MAX + 1}",
        f"gevent-{PROCESSES_MAX + 1}x10",
        "prefork-16x64",  # 1,024 children in all
        f"gevent-2x{POOL_MAX}",
        "gevent-99999999999999999999",
        "prefork-4@sqs",
        "prefork-4\nx",
        "p" * 10_000,
    ],
)
def test_a_spec_out_of_bounds_or_malformed_is_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="celery config"):
        CeleryConfig.parse(spec)


@given(st.text(max_size=40) | st.from_regex(r"(prefork|gevent|threads)-(\d+x)?\d+(@\w+)?"))
def test_any_text_is_a_bounded_deployment_or_a_value_error(spec: str) -> None:
    try:
        config = CeleryConfig.parse(spec)
    except ValueError as error:
        assert "celery config" in str(error)
        return
    most = PREFORK_MAX if config.pool == "prefork" else POOL_MAX
    assert config.concurrency >= 1 and 1 <= config.processes <= PROCESSES_MAX
    assert config.in_flight <= most
    assert config.broker in ("redis", "rabbitmq")
    assert CeleryConfig.parse(config.name) == config
