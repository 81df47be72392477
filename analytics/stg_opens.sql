-- stg_opens: open events. is_machine_open marks opens that are no person reading the mail
-- (Apple Mail Privacy Protection, prefetchers, a provider's bot flag; Gmail's proxy is a
-- person): decided once at ingestion, the rule in docs/webhooks.md "Machine opens". Open rates
-- exclude them and report them apart.
-- Grain: (provider, provider_event_id); a message can be opened many times.
SELECT
    provider, provider_event_id, event_id, message_id, recipient_domain, occurred_at, received_at,
    is_machine_open
FROM stg_provider_events
WHERE event_type = 'opened'
