"""The console logger of every job: each line a JSON object (``email_platform.observability.logs``).

Dagster's event log keeps the sentence the UI shows; this logger writes the same record to the
run's stderr as JSON, with the run id, job, step and the ids the code attached. Starting it
also points the run process's ``email_platform`` stdlib loggers (per-message lines) at stderr
as JSON, at the same level.
"""

import logging

from dagster import Field, InitLoggerContext, LoggerDefinition, logger

from email_platform.observability import logs


@logger(
    {
        "log_level": Field(str, is_required=False, default_value="INFO"),
        "name": Field(str, is_required=False, default_value="email_platform"),
    },
    description="Each log line of the run as one JSON object on stderr (ids as fields).",
)
def json_console_logger(init_context: InitLoggerContext) -> logging.Logger:
    level = init_context.logger_config["log_level"]
    logs.configure(level)
    run_logger = logging.Logger(init_context.logger_config["name"], level=level)
    run_logger.addHandler(logs.json_handler())
    return run_logger


#: Each job's own loggers (not the code location's, which a project that merges these
#: definitions into its own keeps for itself).
JOB_LOGGERS: dict[str, LoggerDefinition] = {"console": json_console_logger}
