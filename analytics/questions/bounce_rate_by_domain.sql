-- Which recipient domains bounce our mail? Bounces over accepted messages per domain,
-- hard (permanent, the address is suppressed) and soft apart. Busiest domains first.
-- The counts are email_funnel_daily's, per domain (which that table does not keep), and the
-- rates its bounce_rate and hard_bounce_rate.
WITH counts AS (
    SELECT
        recipient_domain,
        count(accepted_at) AS accepted,
        count(bounced_at) AS bounced,
        count(*) FILTER (WHERE bounce_type = 'hard') AS hard_bounced,
        count(*) FILTER (WHERE bounce_type = 'soft') AS soft_bounced
    FROM email_funnel
    WHERE accepted_at IS NOT NULL
    GROUP BY recipient_domain
)
SELECT
    *,
    bounced / nullif(accepted, 0) AS bounce_rate,
    hard_bounced / nullif(accepted, 0) AS hard_bounce_rate
FROM counts
ORDER BY accepted DESC, recipient_domain
