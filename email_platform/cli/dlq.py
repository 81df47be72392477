"""``email-platform dlq``: dead letters listed, replayed, discarded."""

import sys

import click

from email_platform.cli.support import migrated_engine as _engine
from email_platform.cli.support import print_json as _print_json


@click.group()
def dlq() -> None:
    """Dead letters: list, replay, discard."""


def _selection(
    ids: tuple[int, ...],
    reason: str | None,
    lane: str | None,
    event: str | None,
    everything: bool,
    url: str | None,
):  # type: ignore[no-untyped-def]
    from email_platform.operating.admin import select_dead_letters

    engine = _engine(url)
    with engine.connect() as connection:
        try:
            letters = select_dead_letters(
                connection, ids=ids, reason=reason, lane=lane, event_id=event, everything=everything
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    return engine, letters


_selectors = [
    click.argument("ids", nargs=-1, type=int, metavar="[DEAD_LETTER_ID]..."),
    click.option("--reason", help="Only dead letters with this reason."),
    click.option("--lane", help="Only this lane."),
    click.option("--event", help="Only this event id."),
    click.option("--all", "everything", is_flag=True, help="Every open dead letter."),
    click.option("--url", help="SQLAlchemy URL of the application database."),
]


def _with_selectors(function):  # type: ignore[no-untyped-def]
    for decorator in reversed(_selectors):
        function = decorator(function)
    return function


@dlq.command("list")
@click.option(
    "--status",
    "status_",
    default="open",
    show_default=True,
    help="open, replayed, discarded, expired, suppressed or 'any'.",
)
@click.option("--reason", help="Only dead letters with this reason.")
@click.option("--lane", help="Only this lane.")
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array.")
@click.option("--url", help="SQLAlchemy URL of the application database.")
def dlq_list(
    status_: str, reason: str | None, lane: str | None, limit: int, as_json: bool, url: str | None
) -> None:
    """List dead letters, oldest first: the error, the attempts, and what the mail was.

    Each shows its template (or event type), lane and recipient masked with a tag
    (j***@example.com #5e0c1a): the same tag is the same address, different tags different
    addresses, yet addresses never appear, in the error text neither. 'past expiry' marks an
    open letter whose message can no longer be sent; `retention purge` or `dlq replay` closes
    it.
    """
    from email_platform.common.timeutil import utcnow
    from email_platform.store import dead_letters

    engine = _engine(url)
    with engine.begin() as connection:  # begin: the first listing makes the tag key
        key = dead_letters.tag_key(connection, utcnow())
    with engine.connect() as connection:
        rows = dead_letters.inbox(
            connection,
            status=None if status_ == "any" else status_,
            reason=reason,
            lane=lane,
            limit=limit,
        )
    now = utcnow()
    letters = [dead_letters.summary(row, now, key) for row in rows]
    if as_json:
        _print_json(letters)
        return
    if not letters:
        click.echo("no dead letters")
    for d in letters:
        what = d["template"] or "(no message)"
        if d["event_type"]:
            what += f" for {d['event_type']}"
        expiry = f"  expires {d['expires_at']}" if d["expires_at"] else ""
        if d["past_expiry"]:
            expiry += " (past expiry)"
        click.echo(
            f"{d['dead_letter_id']:>6}  {d['status']:<9} {d['lane']:<13} {d['reason']:<20} "
            f"attempts={d['attempts']} event={d['event_id']} message={d['message_id']} "
            f"run={d['run_id']}\n"
            f"        {what} to {d['recipient'] or '-'}{expiry}\n"
            f"        error: {d['error'] or '-'}"
        )


@dlq.command("replay")
@_with_selectors
@click.option(
    "--inline",
    is_flag=True,
    help="Send now in this process (recorded in the Dagster instance) instead of "
    "leaving it to the lane sensors of a running daemon.",
)
def dlq_replay(
    ids: tuple[int, ...],
    reason: str | None,
    lane: str | None,
    event: str | None,
    everything: bool,
    url: str | None,
    inline: bool,
) -> None:
    """Send dead letters again with their original idempotency keys.

    DEAD_LETTER_IDs are dead-letter ids: the first column of `email-platform dlq list` (its
    `dead_letter_id` in --json), not event or message ids; select by event with --event.

    \b
    Examples:
      email-platform dlq list
      email-platform dlq replay 12 15           # dead letters 12 and 15
      email-platform dlq replay --reason retries_exhausted --lane bulk
      email-platform dlq replay --all --inline  # send now, without a daemon

    Without --inline the events go back to the outbox and the lane sensors send them on a
    daemon's next tick: with no daemon running (`dagster dev` or `dagster-daemon run` on the
    same DAGSTER_HOME) nothing is sent, and the command warns. Nothing already accepted by the
    provider is sent twice; anything past its expiry becomes 'expired'. The dead letter is
    marked replayed when its message is sent.
    """
    from email_platform.operating.admin import requeue_dead_letters
    from email_platform.operating.retention import expire_dead_letters
    from email_platform.store import dead_letters

    engine, letters = _selection(ids, reason, lane, event, everything, url)
    if not letters:
        click.echo("no open dead letters matched")
        return
    # Past its expiry a message is never sent: close those letters now, as the send path
    # would, instead of requeueing mail that can only expire.
    expired = expire_dead_letters(engine, dead_letter_ids=[d.dead_letter_id for d in letters])
    if expired:
        click.echo(f"{expired} dead letter(s) past their expiry marked expired, not replayed")
        with engine.connect() as connection:
            letters = [
                d
                for d in dead_letters.for_ids(connection, [d.dead_letter_id for d in letters])
                if d.status == dead_letters.OPEN
            ]
        if not letters:
            return
    event_ids = requeue_dead_letters(engine, letters)
    click.echo(f"requeued {len(event_ids)} event(s) for {len(letters)} dead letter(s)")
    if inline:
        from email_platform.local.replay import send_inline

        results = send_inline(event_ids, database_url=url)
        for run_id, success in results:
            click.echo(f"  run {run_id}: {'success' if success else 'failed'}")
        if not all(success for _, success in results):
            sys.exit(1)
    else:
        _say_who_sends()


def _say_who_sends() -> None:
    """Requeued events wait for a daemon to tick the lane sensors: say whether one does."""
    from email_platform.cli.instance import sensor_daemon

    daemon = sensor_daemon()
    if daemon["alive"]:
        click.echo(
            "the lane sensors will send them on their next tick (sensor daemon last beat "
            f"{daemon['last_heartbeat_age_s']:.0f}s ago)"
        )
        return
    where = daemon["instance"] or "DAGSTER_HOME (no dagster.yaml there)"
    seen = (
        "could not be read"
        if daemon["instance"] and daemon["alive"] is None
        else "shows no live sensor daemon"
    )
    click.echo(
        f"WARNING: {where} {seen}: nothing sends these until a daemon ticks the lane sensors "
        "(`dagster dev` or `dagster-daemon run` on that DAGSTER_HOME); or replay them with "
        "--inline to send now",
        err=True,
    )


@dlq.command("discard")
@_with_selectors
def dlq_discard(
    ids: tuple[int, ...],
    reason: str | None,
    lane: str | None,
    event: str | None,
    everything: bool,
    url: str | None,
) -> None:
    """Close dead letters without sending (the message stays dead)."""
    from email_platform.operating.admin import discard_dead_letters

    engine, letters = _selection(ids, reason, lane, event, everything, url)
    count = discard_dead_letters(engine, [d.dead_letter_id for d in letters])
    click.echo(f"discarded {count} dead letter(s)")
