-- email_funnel_daily: per UTC day x template x lane x provider, how far messages got.
-- Grain: (day, template, lane, provider); provider is null for messages never handed to one
-- (suppressed, duplicate, expired). Counts are messages, not events: a message opened five
-- times counts once. Rates are null when their denominator is zero.
--   delivery_rate   = delivered / accepted
--   open_rate       = human_opened / delivered   (machine opens excluded ...)
--   machine_open_rate = machine_opened / delivered  (... and reported apart)
--   click_rate      = clicked / delivered
--   bounce_rate     = bounced / accepted
--   complaint_rate  = complained / delivered
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
    count(delivered_at) / nullif(count(accepted_at), 0) AS delivery_rate,
    count(first_open_at) / nullif(count(delivered_at), 0) AS open_rate,
    count(first_machine_open_at) / nullif(count(delivered_at), 0) AS machine_open_rate,
    count(first_click_at) / nullif(count(delivered_at), 0) AS click_rate,
    count(bounced_at) / nullif(count(accepted_at), 0) AS bounce_rate,
    count(complained_at) / nullif(count(delivered_at), 0) AS complaint_rate,
    median(event_to_accepted_s) AS event_to_accepted_p50_s,
    quantile_cont(event_to_accepted_s, 0.95) AS event_to_accepted_p95_s,
    median(time_to_open_s) AS time_to_open_p50_s
FROM email_funnel
GROUP BY day, template, lane, provider
