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
deliveries AS (
    SELECT message_id, min(occurred_at) AS delivered_at
    FROM stg_deliveries
    GROUP BY message_id
),
opens AS (
    SELECT
        message_id,
        min(occurred_at) FILTER (WHERE NOT is_machine_open) AS first_open_at,
        count(*) FILTER (WHERE NOT is_machine_open) AS open_count,
        min(occurred_at) FILTER (WHERE is_machine_open) AS first_machine_open_at,
        count(*) FILTER (WHERE is_machine_open) AS machine_open_count
    FROM stg_opens
    GROUP BY message_id
),
clicks AS (
    SELECT message_id, min(occurred_at) AS first_click_at, count(*) AS click_count
    FROM stg_clicks
    GROUP BY message_id
),
bounces AS (
    SELECT
        message_id,
        min(occurred_at) AS bounced_at,
        -- One hard bounce makes the message hard-bounced, whatever order they came in.
        CASE WHEN bool_or(bounce_type = 'hard') THEN 'hard' ELSE 'soft' END AS bounce_type
    FROM stg_bounces
    GROUP BY message_id
),
complaints AS (
    SELECT message_id, min(occurred_at) AS complained_at
    FROM stg_complaints
    GROUP BY message_id
),
unsubscribes AS (
    SELECT message_id, min(occurred_at) AS unsubscribed_at
    FROM stg_unsubscribes
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
        d.delivered_at,
        o.first_open_at,
        c.first_click_at,
        b.bounced_at,
        b.bounce_type,
        x.complained_at,
        u.unsubscribed_at,
        o.first_machine_open_at,
        dl.dead_lettered_at,
        s.status AS final_status,
        s.delivery_status,
        s.attempts,
        coalesce(o.open_count, 0) AS open_count,
        coalesce(o.machine_open_count, 0) AS machine_open_count,
        coalesce(c.click_count, 0) AS click_count,
        dl.dead_letter_reason,
        dl.dead_letter_status
    FROM stg_sends AS s
    LEFT JOIN stg_events AS e USING (event_id)
    LEFT JOIN attempts AS a USING (message_id)
    LEFT JOIN deliveries AS d USING (message_id)
    LEFT JOIN opens AS o USING (message_id)
    LEFT JOIN clicks AS c USING (message_id)
    LEFT JOIN bounces AS b USING (message_id)
    LEFT JOIN complaints AS x USING (message_id)
    LEFT JOIN unsubscribes AS u USING (message_id)
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
