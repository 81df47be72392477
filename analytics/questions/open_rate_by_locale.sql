-- Which languages are our emails opened in? Open rate per template and locale, last 7 days.
-- locale is the one whose templates rendered the message, after the fallback chain
-- (a pt-PT reader with only pt templates counts under 'pt'); 'default' is the unlocalized
-- templates. The rate is defined as on email_funnel_daily: human opens over delivered.
WITH window_end AS (
    SELECT max(day) AS last_day FROM email_funnel
),
counts AS (
    SELECT
        template,
        coalesce(locale, 'default') AS locale,
        count(*) AS messages,
        count(delivered_at) AS delivered,
        count(first_open_at) AS human_opened
    FROM email_funnel, window_end
    WHERE day > last_day - 7
    GROUP BY 1, 2
)
SELECT
    *,
    human_opened / nullif(delivered, 0) AS open_rate
FROM counts
ORDER BY template, locale
