-- How long after the provider accepted a message does a person first open it?
-- Per template, the share of human-opened messages in each bucket, and the running total.
WITH opened AS (
    SELECT
        template,
        CASE
            WHEN time_to_open_s < 60 THEN '1. under 1 min'
            WHEN time_to_open_s < 300 THEN '2. 1-5 min'
            WHEN time_to_open_s < 900 THEN '3. 5-15 min'
            WHEN time_to_open_s < 3600 THEN '4. 15-60 min'
            WHEN time_to_open_s < 6 * 3600 THEN '5. 1-6 h'
            WHEN time_to_open_s < 24 * 3600 THEN '6. 6-24 h'
            ELSE '7. over 1 day'
        END AS bucket
    FROM email_funnel
    WHERE time_to_open_s IS NOT NULL
)
SELECT
    template,
    bucket,
    count(*) AS opened,
    count(*) / sum(count(*)) OVER (PARTITION BY template) AS share,
    sum(count(*)) OVER (PARTITION BY template ORDER BY bucket)
        / sum(count(*)) OVER (PARTITION BY template) AS cumulative_share
FROM opened
GROUP BY template, bucket
ORDER BY template, bucket
