"""``email-platform cancel``: take back events that should no longer be sent."""

import click

from email_platform.cli.support import migrated_engine as _engine
from email_platform.cli.support import print_json as _print_json


@click.command()
@click.argument("event_ids", nargs=-1)
@click.option(
    "--idempotency-key",
    "keys",
    multiple=True,
    help="Cancel the event published with this idempotency key (repeatable).",
)
@click.option("--url", help="SQLAlchemy URL of the application database.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cancel(
    event_ids: tuple[str, ...], keys: tuple[str, ...], url: str | None, as_json: bool
) -> None:
    """Cancel events not sent yet: EVENT_ID... or --idempotency-key KEY.

    Only a pending event no worker holds is cancelled. One a worker holds right now is
    reported in flight (it may be sent), one already accepted by the provider as already sent
    with its messages. Each event is cancelled in its own transaction. Exits 1 when nothing
    was cancelled.
    """
    from email_platform.publishing.cancelling import cancel as cancel_event

    if not event_ids and not keys:
        raise click.UsageError("say what to cancel: EVENT_ID... or --idempotency-key KEY")
    engine = _engine(url)
    results = []
    asked = [("event_id", value) for value in event_ids] + [
        ("idempotency_key", value) for value in keys
    ]
    for kind, value in asked:
        with engine.begin() as connection:
            result = cancel_event(connection, **{kind: value})
        results.append((kind, value, result))
    cancelled = sum(1 for *_, result in results if result.cancelled)
    if as_json:
        _print_json(
            {
                "cancelled": cancelled,
                "results": [
                    {
                        "asked": {kind: value},
                        "status": str(result.status),
                        "event_id": result.event_id,
                        "event_status": result.event_status,
                        "resolution": result.resolution,
                        "claimed_by": result.claimed_by,
                        "sent_messages": [
                            {
                                "message_id": m.message_id,
                                "route": m.route,
                                "provider": m.provider,
                                "provider_message_id": m.provider_message_id,
                            }
                            for m in result.sent_messages
                        ],
                        "attempted_messages": list(result.attempted_messages),
                    }
                    for kind, value, result in results
                ],
            }
        )
    else:
        for kind, value, result in results:
            line = result.describe()
            click.echo(line if result.event_id else f"{kind} {value!r}: {line}")
        click.echo(f"cancelled {cancelled} of {len(results)}")
    if not cancelled:
        raise SystemExit(1)
