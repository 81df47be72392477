-- Where do messages fall out between the event and the inbox, per template?
-- Each step counts messages that reached it; the *_rate columns are step-to-step conversion.
SELECT
    template,
    count(*) AS messages,
    count(*) FILTER (WHERE final_status = 'suppressed') AS suppressed,
    count(*) FILTER (WHERE final_status = 'duplicate') AS duplicate,
    count(*) FILTER (WHERE final_status = 'expired') AS expired,
    count(*) FILTER (WHERE final_status = 'dead') AS dead,
    count(*) FILTER (WHERE final_status = 'pending') AS pending,
    count(accepted_at) AS accepted,
    count(delivered_at) AS delivered,
    count(bounced_at) AS bounced,
    count(first_open_at) AS human_opened,
    count(first_click_at) AS clicked,
    count(accepted_at) / nullif(count(*), 0) AS accepted_rate,
    count(delivered_at) / nullif(count(accepted_at), 0) AS delivered_rate,
    count(first_open_at) / nullif(count(delivered_at), 0) AS opened_rate,
    count(first_click_at) / nullif(count(first_open_at), 0) AS clicked_after_open_rate,
    median(event_to_accepted_s) AS event_to_accepted_p50_s
FROM email_funnel
GROUP BY template
ORDER BY messages DESC
