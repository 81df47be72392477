"""``python -m bench.faults.reexecute RUN_ID``: what an operator's "Re-execute from failure"
in the Dagster UI does to a failed send run, from a process of its own: a new run of the same
job, parent ``RUN_ID``, recorded in the instance at ``DAGSTER_HOME``. Exits 0 when it succeeds.

The drain starts two of these for one failed run at the same moment, beside the dlq replays,
so a re-execution runs while its successor (another replay of the same letters) is running.
"""

import sys

from dagster import DagsterInstance, JobDefinition, ReexecutionOptions, execute_job, reconstructable

from email_platform.definitions import build_definitions


def send_job() -> JobDefinition:
    return build_definitions().get_job_def("send_email_job")


def main(argv: list[str]) -> int:
    (run_id,) = argv
    with (
        DagsterInstance.get() as instance,
        execute_job(
            reconstructable(send_job),
            instance=instance,
            reexecution_options=ReexecutionOptions.from_failure(run_id, instance),
            tags={"email/replay": "faults-reexecute"},
        ) as result,
    ):
        return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
