"""Structured log lines: every line a JSON object, so one search finds a message's whole story.

Code logs a human sentence and hands the ids it knows as fields (``fields(...)``, or a logger
from ``bind(...)`` that adds them to every line). ``JsonFormatter`` writes the sentence as
``msg`` beside those fields, and the run id, job and step Dagster attaches to its own records.
JSON escapes every control character, so a hostile value can neither break a line nor forge one.

The same fields reach every sink: Dagster's event log keeps the sentence (what the UI shows),
the run's console logger (``email_platform.jobs.loggers``) and the processes' stderr get the JSON,
and sensor tick logs store each record whole, fields included. Per-message lines (a message
accepted, a webhook applied) go to the stdlib logger ``email_platform.messages`` only: one
event-log row per email would cost the database more than the send.
"""

import json
import logging
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from datetime import UTC, datetime
from select import PIPE_BUF
from typing import Any, TextIO

#: The ids a line carries where known, in the order they are written.
FIELDS = (
    "event_id",
    "message_id",
    "idempotency_key",
    "provider_message_id",
    "run_id",
    "lane",
    "provider",
    "trace_id",
    "correlation_id",
)
#: The record attribute the fields travel in (one name: no clash with LogRecord's own).
ATTRIBUTE = "email_fields"
#: Per-message lines: one for each message accepted, each webhook event applied.
MESSAGES_LOGGER = "email_platform.messages"
_HANDLER_MARK = "_email_platform_json"
#: One encoder for every line (``json.dumps`` with options builds a new one per call).
_ENCODER = json.JSONEncoder(default=str, ensure_ascii=True)
_DAGSTER_META = "dagster_meta"


def fields(**values: Any) -> dict[str, Any]:
    """``extra=`` for one log call: ``log.info("sent", **fields(event_id=...))``.

    None values are left out, so a line says only what is known."""
    return {"extra": {ATTRIBUTE: {k: v for k, v in values.items() if v is not None}}}


def trace_fields(item: Any) -> dict[str, Any]:
    """``trace_id`` and ``correlation_id`` of an outbox row or ``OutgoingEmail``, those set."""
    return {
        name: value
        for name in ("trace_id", "correlation_id")
        if (value := getattr(item, name, None))
    }


class BoundLogger(logging.LoggerAdapter):
    """A logger whose every line carries ``bound`` fields, merged with the call's own.

    Works over a stdlib logger and over Dagster's ``context.log`` alike (both take ``extra``).
    """

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter, **bound: Any) -> None:
        super().__init__(logger, {k: v for k, v in bound.items() if v is not None})  # type: ignore[arg-type]

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        extra = dict(kwargs.get("extra") or {})
        extra[ATTRIBUTE] = {**(self.extra or {}), **extra.get(ATTRIBUTE, {})}
        kwargs["extra"] = extra
        return msg, kwargs

    def bind(self, **more: Any) -> "BoundLogger":
        return BoundLogger(self.logger, **{**(self.extra or {}), **more})

    def info_each(self, msg: str, each: Iterable[Mapping[str, Any]]) -> None:
        """One INFO line per mapping of fields, as ``info(msg, **fields(...))`` would write it.

        For per-message lines written in a loop (a group's accepted sends): the records are
        made directly, without the adapter's merge and the caller lookup for each, which cost
        about as much as formatting the line. Every record still passes the logger's level,
        filters and handlers; None values are left out, as ``fields`` leaves them out.

        Where the lines reach only this module's JSON handlers (a run process: no filters, no
        other handler on the way up), they are formatted here and each handler's stream gets
        the group in a few writes: the same lines, with the group's one timestamp, without a
        record, a format call and a flush per line (their CPU: bench/README.md).
        """
        logger = self.logger
        while isinstance(logger, logging.LoggerAdapter):
            logger = logger.logger
        if not logger.isEnabledFor(logging.INFO):
            return
        bound = self.extra or {}
        lines = [{**bound, **{k: v for k, v in values.items() if v is not None}} for values in each]
        handlers = _json_handlers_only(logger)
        if handlers is not None and _write_lines(handlers, logger.name, msg, lines):
            return
        caller = sys._getframe(1)  # where the lines come from, looked up once
        path, line_no, function = caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name
        for line in lines:
            extra = {ATTRIBUTE: line}
            record = logger.makeRecord(
                logger.name, logging.INFO, path, line_no, msg, (), None, function, extra
            )
            logger.handle(record)


def _json_handlers_only(logger: logging.Logger) -> list[logging.StreamHandler] | None:
    """The handlers an INFO record of ``logger`` reaches, when every one is a JSON handler of
    this module with nothing to decide per record (no filter on a logger or handler, no
    formatter swapped); else None. The walk is ``Logger.callHandlers``'s."""
    if logger.disabled:
        return None
    found: list[logging.StreamHandler] = []
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters:
            return None
        for handler in current.handlers:
            if not (
                getattr(handler, _HANDLER_MARK, False)
                and isinstance(handler, logging.StreamHandler)
                and type(handler.formatter) is JsonFormatter
                and not handler.filters
            ):
                return None
            if handler.level <= logging.INFO:
                found.append(handler)
        current = current.parent if current.propagate else None  # type: ignore[assignment]
    # No handler at all: the per-record path, where logging's last resort decides.
    return found or None


def _write_lines(
    handlers: list[logging.StreamHandler],
    name: str,
    msg: str,
    lines: list[dict[str, Any]],
) -> bool:
    """``JsonFormatter``'s lines for plain INFO records of ``name``, written to each handler's
    stream under its lock and flushed, as ``StreamHandler.emit`` does per record; False, with
    nothing written, when a value cannot be encoded (the per-record path then reports it).

    A write holds whole lines of at most ``PIPE_BUF`` bytes together (a longer line alone, as
    before), so a pipe other processes also write to never gets a line cut by theirs."""
    head = {
        "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "level": "info",
        "logger": name,
        "msg": msg,
    }
    try:
        encoded = [_ENCODER.encode({**head, **line}) + "\n" for line in lines]
    except Exception:
        return False
    chunks: list[str] = []
    size = PIPE_BUF
    for line in encoded:  # ASCII: a character is a byte
        if size + len(line) > PIPE_BUF:
            chunks.append("")
            size = 0
        chunks[-1] += line
        size += len(line)
    for handler in handlers:
        handler.acquire()
        try:
            for chunk in chunks:
                handler.stream.write(chunk)
                handler.flush()
        except RecursionError:
            raise
        except Exception:
            handler.handleError(logging.makeLogRecord({"name": name, "msg": msg}))
        finally:
            handler.release()
    return True


def bind(logger: logging.Logger | logging.LoggerAdapter, **bound: Any) -> BoundLogger:
    """``logger`` with ``bound`` fields on every line (``lane``, ``run_id`` ...)."""
    if isinstance(logger, BoundLogger):
        return logger.bind(**bound)
    return BoundLogger(logger, **bound)


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record carries (empty when it was logged without any)."""
    found = getattr(record, ATTRIBUTE, None)
    return dict(found) if isinstance(found, Mapping) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``msg``, then the fields.

    On a Dagster record the sentence is the one the code logged (not Dagster's
    ``job - run - step - msg`` prefix), and its run id, job, step and event type are fields.
    """

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        meta = getattr(record, _DAGSTER_META, None)
        if isinstance(meta, Mapping):
            line["msg"] = str(meta.get("orig_message") or record.getMessage())
            for key, name in (("run_id", "run_id"), ("job_name", "job"), ("step_key", "step")):
                if meta.get(key):
                    line[name] = meta[key]
            event = meta.get("dagster_event")
            event_type = getattr(event, "event_type_value", None)
            if event_type:
                line["dagster_event"] = event_type
            if meta.get("name") and "job" not in line:
                line["sensor"] = meta["name"]  # a sensor's or schedule's record
        else:
            line["msg"] = record.getMessage()
        line.update(fields_of(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(line)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the moment (a host may swap it, as pytest and
    Dagster's log capture do), never to a stream closed since."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def json_handler(stream: TextIO | None = None) -> logging.Handler:
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStderr()
    handler.setFormatter(JsonFormatter())
    setattr(handler, _HANDLER_MARK, True)
    return handler


def configure(level: int | str = logging.INFO, stream: TextIO | None = None) -> logging.Logger:
    """Write the ``email_platform`` loggers' lines to stderr as JSON, at ``level``.

    Idempotent: a process that calls it twice still writes each line once (the level is
    updated). Records still propagate, so a host's own handlers (pytest's, an embedding
    application's) see them too.
    """
    logger = logging.getLogger("email_platform")
    logger.setLevel(level)
    if not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        logger.addHandler(json_handler(stream))
    return logger


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """``uvicorn.run(log_config=...)``: uvicorn's own lines and ours, as JSON on stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"stderr": handler},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "email_platform": {"handlers": ["stderr"], "level": level.upper()},
        },
    }
