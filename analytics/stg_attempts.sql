-- stg_attempts: one row per provider call for a message.
-- Grain: attempt_id. outcome is accepted | transient | permanent.
-- event_id is the message's: the warehouse stores it once, on the message (raw_email_attempts
-- keeps it only where it differs).
SELECT
    a.attempt_id,
    a.message_id,
    coalesce(a.event_id, m.event_id) AS event_id,
    a.run_id,
    a.attempt_no,
    a.started_at,
    a.finished_at,
    a.outcome,
    a.http_status,
    (epoch_ms(a.finished_at) - epoch_ms(a.started_at)) / 1000.0 AS duration_s
FROM raw_email_attempts AS a
LEFT JOIN raw_email_messages AS m ON m.message_id = a.message_id
-- A test send's attempts (templates send-test) are left out, as its message is.
WHERE NOT coalesce(m.is_test, false)
