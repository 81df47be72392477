-- stg_sends: one row per message (an event x route) and what became of it.
-- Grain: message_id. accepted_at is when the provider accepted the message (status 'sent').
-- Test sends (email-platform templates send-test) are left out here, so out of the funnel.
SELECT
    message_id,
    event_id,
    route,
    template,
    template_version,
    lane,
    provider,
    provider_message_id,
    recipient_domain,
    status,           -- pending | sent | suppressed | expired | duplicate | dead
    attempts,
    delivery_status,  -- highest-ranked provider event seen for the message
    created_at,
    updated_at,
    sent_at AS accepted_at,
    delivery_updated_at,
    locale            -- the locale whose templates rendered it (pt-BR, pt); null = default
FROM raw_email_messages
WHERE NOT coalesce(is_test, false)
