-- What were each template's rates over the last 7 days, and every message's together?
-- The numbers on email_funnel_daily's page in Dagster (in percent there: "1 open rate, all,
-- 7d (%)", ...) and in the demo's funnel: the 7 days ending on the newest day with messages (UTC, by
-- the day each message was created), the rates as email_funnel_daily defines them. The
-- overall row has template null; ORDER BY puts it first.
WITH counts AS (
    SELECT
        template,
        sum(messages) AS messages,
        sum(accepted) AS accepted,
        sum(delivered) AS delivered,
        sum(human_opened) AS human_opened,
        sum(machine_opened) AS machine_opened,
        sum(clicked) AS clicked,
        sum(bounced) AS bounced,
        sum(hard_bounced) AS hard_bounced,
        sum(complained) AS complained
    FROM email_funnel_daily
    WHERE day > (SELECT max(day) FROM email_funnel_daily) - 7
    GROUP BY ROLLUP (template)
)
SELECT
    *,
    delivered / nullif(accepted, 0) AS delivery_rate,
    human_opened / nullif(delivered, 0) AS open_rate,
    machine_opened / nullif(delivered, 0) AS machine_open_rate,
    clicked / nullif(delivered, 0) AS click_rate,
    bounced / nullif(accepted, 0) AS bounce_rate,
    complained / nullif(delivered, 0) AS complaint_rate
FROM counts
ORDER BY template NULLS FIRST
