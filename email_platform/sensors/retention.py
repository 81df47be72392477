"""The scheduled purge of operational history past its retention."""

from dagster import JobDefinition, ScheduleDefinition

retention_jobs: list[JobDefinition] = []
retention_schedules: list[ScheduleDefinition] = []
