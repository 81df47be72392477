-- email_funnel_daily: per UTC day x template x lane x provider, how far messages got.
-- Grain: (day, template, lane, provider); provider is null for messages never handed to one
-- (suppressed, duplicate, expired). Counts are messages, not events: a message opened five
-- times counts once.
-- The rates below are THE definition of each rate: the questions, the Dagster metadata and
-- chart, the demo and the CLI compute them exactly so (a count over a count, null when the
-- denominator is zero). Over several days or templates, a rate is the sum of its numerator
-- over the sum of its denominator, never an average of the daily rates:
--   SELECT sum(human_opened) / nullif(sum(delivered), 0) AS open_rate FROM email_funnel_daily
-- Machine opens (mail privacy proxies) are left out of open_rate and reported apart.
WITH counts AS (
    SELECT
        day,
        template,
        lane,
        provider,
        count(*) AS messages,
        count(accepted_at) AS accepted,
        count(delivered_at) AS delivered,
        count(first_open_at) AS human_opened,
        count(first_machine_open_at) FILTER (WHERE first_open_at IS NULL) AS machine_opened_only,
        count(first_machine_open_at) AS machine_opened,
        count(first_click_at) AS clicked,
        count(bounced_at) AS bounced,
        count(*) FILTER (WHERE bounce_type = 'hard') AS hard_bounced,
        count(complained_at) AS complained,
        count(unsubscribed_at) AS unsubscribed,
        count(*) FILTER (WHERE final_status = 'suppressed') AS suppressed,
        count(*) FILTER (WHERE final_status = 'duplicate') AS duplicate,
        count(*) FILTER (WHERE final_status = 'expired') AS expired,
        count(*) FILTER (WHERE final_status = 'dead') AS dead,
        count(*) FILTER (WHERE final_status = 'pending') AS pending,
        median(event_to_accepted_s) AS event_to_accepted_p50_s,
        quantile_cont(event_to_accepted_s, 0.95) AS event_to_accepted_p95_s,
        median(time_to_open_s) AS time_to_open_p50_s
    FROM email_funnel
    GROUP BY day, template, lane, provider
)
SELECT
    *,
    accepted / nullif(messages, 0) AS acceptance_rate,
    delivered / nullif(accepted, 0) AS delivery_rate,
    human_opened / nullif(delivered, 0) AS open_rate,
    machine_opened / nullif(delivered, 0) AS machine_open_rate,
    clicked / nullif(delivered, 0) AS click_rate,
    clicked / nullif(human_opened, 0) AS click_to_open_rate,
    bounced / nullif(accepted, 0) AS bounce_rate,
    hard_bounced / nullif(accepted, 0) AS hard_bounce_rate,
    complained / nullif(delivered, 0) AS complaint_rate
FROM counts
