-- What was the welcome email's open rate, week by week (newest first)?
-- Human opens only: opens by mail privacy proxies (machine opens) are shown apart.
-- Weeks start on Monday (UTC), by the day the message was created. (The last 7 days, what
-- Dagster plots as "2 open rate, welcome, 7d (%)": rates_by_template_last_7_days.sql.)
SELECT
    date_trunc('week', day) AS week,
    sum(accepted) AS accepted,
    sum(delivered) AS delivered,
    sum(human_opened) AS human_opened,
    sum(human_opened) / nullif(sum(delivered), 0) AS open_rate,
    sum(machine_opened) AS machine_opened,
    sum(machine_opened) / nullif(sum(delivered), 0) AS machine_open_rate,
    sum(clicked) / nullif(sum(delivered), 0) AS click_rate
FROM email_funnel_daily
WHERE template = 'welcome'
GROUP BY week
ORDER BY week DESC
