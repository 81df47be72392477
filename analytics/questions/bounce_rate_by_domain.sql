-- Which recipient domains bounce our mail? Bounces over accepted messages per domain,
-- hard (permanent, the address is suppressed) and soft apart. Busiest domains first.
SELECT
    recipient_domain,
    count(accepted_at) AS accepted,
    count(bounced_at) AS bounced,
    count(*) FILTER (WHERE bounce_type = 'hard') AS hard_bounced,
    count(*) FILTER (WHERE bounce_type = 'soft') AS soft_bounced,
    count(bounced_at) / nullif(count(accepted_at), 0) AS bounce_rate,
    count(*) FILTER (WHERE bounce_type = 'hard') / nullif(count(accepted_at), 0)
        AS hard_bounce_rate
FROM email_funnel
WHERE accepted_at IS NOT NULL
GROUP BY recipient_domain
ORDER BY accepted DESC, recipient_domain
