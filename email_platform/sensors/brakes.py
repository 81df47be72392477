"""Brakes: sensors that pause the bulk lane when its bounce or complaint rate spikes."""

from dagster import SensorDefinition

brake_sensors: list[SensorDefinition] = []
