-- stg_clicks: link clicks. Grain: (provider, provider_event_id).
SELECT
    provider, provider_event_id, event_id, message_id, recipient_domain, occurred_at, received_at,
    click_url
FROM stg_provider_events
WHERE event_type = 'clicked'
