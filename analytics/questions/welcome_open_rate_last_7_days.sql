-- What was the welcome email's open rate over the last 7 days?
-- The number Dagster plots (in percent) as "2 open rate, welcome, 7d (%)" on
-- email_funnel_daily and the demo prints:
-- the 7 days ending on the newest day with messages (UTC, by the day each message was
-- created); human opens over delivered messages, machine opens shown apart.
WITH window_end AS (
    SELECT max(day) AS last_day FROM email_funnel_daily
),
counts AS (
    SELECT
        last_day - 6 AS first_day,
        last_day,
        sum(accepted) AS accepted,
        sum(delivered) AS delivered,
        sum(human_opened) AS human_opened,
        sum(machine_opened) AS machine_opened
    FROM email_funnel_daily, window_end
    WHERE template = 'welcome' AND day > last_day - 7
    GROUP BY last_day
)
SELECT
    *,
    human_opened / nullif(delivered, 0) AS open_rate,
    machine_opened / nullif(delivered, 0) AS machine_open_rate
FROM counts
