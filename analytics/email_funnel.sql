-- email_funnel: one row per message, every hop joined on event_id / message_id.
-- Grain: message_id. All timestamps are UTC; each step is its FIRST occurrence, so duplicate
-- and out-of-order provider events change nothing. Latencies are in seconds; the provider-side
-- ones (delivery, open, click, bounce) compare the provider's clock with ours and can dip a
-- little below zero when the two disagree.
-- day is the UTC day the message was created (the day the event entered the pipeline); it
-- never changes, so a day's numbers only grow as late provider events arrive.
WITH
attempts AS (
    SELECT message_id, min(started_at) AS first_attempt_at, count(*) AS attempt_rows
    FROM stg_attempts
    GROUP BY message_id
),
-- One pass over the provider events for every step they mark (a scan per step cost six
-- scans of the largest table); stg_deliveries, stg_opens, ... hold the same rows one type each.
provider_steps AS (
    SELECT
        message_id,
        min(occurred_at) FILTER (WHERE event_type = 'delivered') AS delivered_at,
        min(occurred_at) FILTER (WHERE event_type = 'opened' AND NOT is_machine_open)
            AS first_open_at,
        count(*) FILTER (WHERE event_type = 'opened' AND NOT is_machine_open) AS open_count,
        min(occurred_at) FILTER (WHERE event_type = 'opened' AND is_machine_open)
            AS first_machine_open_at,
        count(*) FILTER (WHERE event_type = 'opened' AND is_machine_open) AS machine_open_count,
        min(occurred_at) FILTER (WHERE event_type = 'clicked') AS first_click_at,
        count(*) FILTER (WHERE event_type = 'clicked') AS click_count,
        min(occurred_at) FILTER (WHERE event_type = 'bounced') AS bounced_at,
        -- One hard bounce makes the message hard-bounced, whatever order they came in.
        CASE
            WHEN bool_or(bounce_type = 'hard') FILTER (WHERE event_type = 'bounced') THEN 'hard'
            WHEN count(*) FILTER (WHERE event_type = 'bounced') > 0 THEN 'soft'
        END AS bounce_type,
        min(occurred_at) FILTER (WHERE event_type = 'complained') AS complained_at,
        min(occurred_at) FILTER (WHERE event_type = 'unsubscribed') AS unsubscribed_at
    FROM stg_provider_events
    WHERE message_id IS NOT NULL
    GROUP BY message_id
),
dead AS (
    SELECT
        message_id,
        min(created_at) AS dead_lettered_at,
        arg_max(reason, dead_letter_id) AS dead_letter_reason,
        arg_max(status, dead_letter_id) AS dead_letter_status
    FROM stg_dead_letters
    WHERE message_id IS NOT NULL
    GROUP BY message_id
),
steps AS (
    SELECT
        s.message_id,
        s.event_id,
        e.event_type,
        e.event_version,
        s.route,
        s.template,
        s.template_version,
        s.lane,
        s.provider,
        s.recipient_domain,
        CAST(s.created_at AS DATE) AS day,
        e.occurred_at AS event_occurred_at,
        e.published_at,
        s.created_at,
        a.first_attempt_at,
        s.accepted_at,
        p.delivered_at,
        p.first_open_at,
        p.first_click_at,
        p.bounced_at,
        p.bounce_type,
        p.complained_at,
        p.unsubscribed_at,
        p.first_machine_open_at,
        dl.dead_lettered_at,
        s.status AS final_status,
        s.delivery_status,
        s.attempts,
        coalesce(p.open_count, 0) AS open_count,
        coalesce(p.machine_open_count, 0) AS machine_open_count,
        coalesce(p.click_count, 0) AS click_count,
        dl.dead_letter_reason,
        dl.dead_letter_status,
        e.trace_id,
        e.correlation_id,
        e.producer,
        s.locale
    FROM stg_sends AS s
    LEFT JOIN stg_events AS e USING (event_id)
    LEFT JOIN attempts AS a USING (message_id)
    LEFT JOIN provider_steps AS p USING (message_id)
    LEFT JOIN dead AS dl USING (message_id)
)
SELECT
    *,
    (epoch_ms(published_at) - epoch_ms(event_occurred_at)) / 1000.0 AS publish_delay_s,
    (epoch_ms(first_attempt_at) - epoch_ms(published_at)) / 1000.0 AS queue_delay_s,
    (epoch_ms(accepted_at) - epoch_ms(first_attempt_at)) / 1000.0 AS send_duration_s,
    (epoch_ms(accepted_at) - epoch_ms(event_occurred_at)) / 1000.0 AS event_to_accepted_s,
    (epoch_ms(delivered_at) - epoch_ms(accepted_at)) / 1000.0 AS delivery_delay_s,
    (epoch_ms(first_open_at) - epoch_ms(accepted_at)) / 1000.0 AS time_to_open_s,
    (epoch_ms(first_click_at) - epoch_ms(accepted_at)) / 1000.0 AS time_to_click_s,
    (epoch_ms(bounced_at) - epoch_ms(accepted_at)) / 1000.0 AS time_to_bounce_s
FROM steps
