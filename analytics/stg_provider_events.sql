-- stg_provider_events: every normalized provider event (webhook-derived), each stored once.
-- Grain: (provider, provider_event_id). occurred_at is the provider's clock, received_at ours.
-- message_id is null for an orphan: a provider event that matched no message of ours.
SELECT
    provider,
    provider_event_id,
    email_event_id,
    event_type,
    occurred_at,
    received_at,
    event_id,
    message_id,
    provider_message_id,
    recipient_domain,
    reject_reason,
    bounce_type,
    click_url,
    coalesce(machine_open, false) AS is_machine_open
FROM raw_email_events
-- A test send's provider events (templates send-test) are left out, as its message is.
WHERE message_id IS NULL
    OR message_id NOT IN (SELECT message_id FROM raw_email_messages WHERE is_test)
