"""The alert op: one run per raised or resolved alert, so each shows in the UI's run list."""

from datetime import datetime

from dagster import Config, MetadataValue, OpExecutionContext, op

from email_platform.observability import logs
from email_platform.operating.alerts import notify
from email_platform.resources.alerts import AlertSettings
from email_platform.store.alerts import Transition


class AlertConfig(Config):
    key: str
    kind: str
    lane: str | None = None
    severity: str = "error"
    summary: str
    state: str
    raised_at: str
    raise_count: int = 1


@op(tags={"kind": "email"})
def announce_alert(
    context: OpExecutionContext, config: AlertConfig, email_alerts: AlertSettings
) -> dict:
    """Log the alert as one JSON line and post it to the Slack-compatible webhook if one is
    configured (retried with backoff). A post that fails is logged as an error; the run still
    succeeds, so an unreachable chat never raises an alert of its own in a loop.
    """
    transition = Transition(
        key=config.key,
        kind=config.kind,
        lane=config.lane,
        severity=config.severity,
        summary=config.summary,
        state=config.state,
        raised_at=datetime.fromisoformat(config.raised_at),
        raise_count=config.raise_count,
    )
    line = notify.alert_line(transition)
    where = logs.fields(alert=config.key, lane=config.lane, state=config.state)
    if config.state == "raised":
        context.log.error(line, **where)
    else:
        context.log.info(line, **where)
    url = email_alerts.resolved_slack_url()
    posted: str = "no Slack URL configured"
    if url:
        error = notify.post(notify.check_url(url), transition)
        posted = "posted" if error is None else f"not posted: {error}"
        if error is not None:
            context.log.error(
                f"alert {config.key} {config.state}: Slack post failed: {error}", **where
            )
    context.add_output_metadata(
        {
            "alert": config.key,
            "state": config.state,
            "summary": MetadataValue.text(config.summary),
            "slack": posted,
        }
    )
    return {"key": config.key, "state": config.state, "slack": posted}
