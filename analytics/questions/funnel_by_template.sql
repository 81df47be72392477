-- Where do messages fall out between the event and the inbox, per template?
-- Each step counts messages that reached it; the rates are email_funnel_daily's (see its
-- header): acceptance of messages, delivery of accepted, opens of delivered, clicks of opens.
WITH counts AS (
    SELECT
        template,
        sum(messages) AS messages,
        sum(suppressed) AS suppressed,
        sum(duplicate) AS duplicate,
        sum(expired) AS expired,
        sum(dead) AS dead,
        sum(pending) AS pending,
        sum(accepted) AS accepted,
        sum(delivered) AS delivered,
        sum(bounced) AS bounced,
        sum(human_opened) AS human_opened,
        sum(clicked) AS clicked
    FROM email_funnel_daily
    GROUP BY template
),
latency AS (
    SELECT template, median(event_to_accepted_s) AS event_to_accepted_p50_s
    FROM email_funnel
    GROUP BY template
)
SELECT
    counts.*,
    accepted / nullif(messages, 0) AS acceptance_rate,
    delivered / nullif(accepted, 0) AS delivery_rate,
    human_opened / nullif(delivered, 0) AS open_rate,
    clicked / nullif(human_opened, 0) AS click_to_open_rate,
    latency.event_to_accepted_p50_s
FROM counts
LEFT JOIN latency USING (template)
ORDER BY messages DESC, template
