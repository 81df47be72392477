-- stg_bounces: bounces. bounce_type is hard (permanent: the address is suppressed) or soft.
-- A bounce can arrive after a delivered event (an asynchronous bounce); both are kept.
-- Grain: (provider, provider_event_id).
SELECT
    provider, provider_event_id, event_id, message_id, recipient_domain, occurred_at, received_at,
    bounce_type, reject_reason
FROM stg_provider_events
WHERE event_type = 'bounced'
