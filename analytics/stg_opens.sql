-- stg_opens: open events. is_machine_open marks opens by a mail client's privacy proxy
-- (Apple Mail Privacy Protection and the like): they are not people reading the mail, so open
-- rates exclude them and report them apart.
-- Grain: (provider, provider_event_id); a message can be opened many times.
SELECT
    provider, provider_event_id, event_id, message_id, recipient_domain, occurred_at, received_at,
    is_machine_open
FROM stg_provider_events
WHERE event_type = 'opened'
