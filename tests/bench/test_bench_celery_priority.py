"""The Celery baseline's critical tasks are delivered first on each broker it can use.

kombu's Redis transport and RabbitMQ read priorities in opposite directions; the relay once
gave critical tasks 9 on Redis, which Redis delivers last. Checked against the real brokers."""

import os
import uuid

import kombu
import pytest

from bench.baseline_celery import AMQP_URL, priority_of

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
REDIS_OPTIONS = {"queue_order_strategy": "priority", "priority_steps": [0, 9]}


def _first_delivered(url: str, options: dict, broker: str, queue_arguments: dict) -> str:
    name = f"bench-priority-{uuid.uuid4().hex[:8]}"
    try:
        connection = kombu.Connection(url, transport_options=options, connect_timeout=3)
        connection.connect()
    except Exception as exc:  # no such broker here
        pytest.skip(f"{broker} is not reachable at {url} ({type(exc).__name__})")
    with connection:
        queue = kombu.Queue(
            name, kombu.Exchange(name, auto_delete=True), name, queue_arguments=queue_arguments
        )
        try:
            with connection.SimpleQueue(queue) as simple:
                for body in ("bulk-1", "bulk-2", "critical", "bulk-3"):
                    lane = "critical" if body == "critical" else "bulk"
                    simple.put(body, priority=priority_of(lane, broker))
                message = simple.get(timeout=5)
                message.ack()
                simple.clear()
                return message.payload
        finally:
            if broker == "rabbitmq":
                queue.bind(connection.default_channel).delete()


def test_on_redis_the_critical_task_is_delivered_before_the_bulk_ones_queued_ahead():
    assert _first_delivered(REDIS_URL, REDIS_OPTIONS, "redis", {}) == "critical"


def test_on_rabbitmq_the_critical_task_is_delivered_before_the_bulk_ones_queued_ahead():
    arguments = {"x-max-priority": 9}
    assert _first_delivered(AMQP_URL, {}, "rabbitmq", arguments) == "critical"


def test_the_two_brokers_get_opposite_numbers_for_the_same_lane():
    assert priority_of("critical", "redis") == 0 and priority_of("bulk", "redis") == 9
    assert priority_of("critical", "rabbitmq") == 9 and priority_of("bulk", "rabbitmq") == 0
