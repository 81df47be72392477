-- stg_unsubscribes: provider events saying the recipient unsubscribed through the message.
-- Grain: (provider, provider_event_id); a message can have more than one.
SELECT provider, provider_event_id, event_id, message_id, recipient_domain, occurred_at, received_at
FROM stg_provider_events
WHERE event_type = 'unsubscribed'
