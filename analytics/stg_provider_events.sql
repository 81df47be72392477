-- stg_provider_events: every normalized provider event (webhook-derived), each stored once.
-- Grain: (provider, provider_event_id). occurred_at is the provider's clock, received_at ours.
-- message_id is null for an orphan: a provider event that matched no message of ours.
-- event_id is the message's unless the event named another (raw_email_events keeps it only
-- then, and for orphans).
SELECT
    e.provider,
    e.provider_event_id,
    e.email_event_id,
    e.event_type,
    e.occurred_at,
    e.received_at,
    coalesce(e.event_id, m.event_id) AS event_id,
    e.message_id,
    e.provider_message_id,
    e.recipient_domain,
    e.reject_reason,
    e.bounce_type,
    e.click_url,
    coalesce(e.machine_open, false) AS is_machine_open
FROM raw_email_events AS e
LEFT JOIN raw_email_messages AS m ON m.message_id = e.message_id
-- A test send's provider events (templates send-test) are left out, as its message is.
WHERE NOT coalesce(m.is_test, false)
