-- stg_attempts: one row per provider call for a message.
-- Grain: attempt_id. outcome is accepted | transient | permanent.
SELECT
    attempt_id,
    message_id,
    event_id,
    run_id,
    attempt_no,
    started_at,
    finished_at,
    outcome,
    http_status,
    (epoch_ms(finished_at) - epoch_ms(started_at)) / 1000.0 AS duration_s
FROM raw_email_attempts
-- A test send's attempts (templates send-test) are left out, as its message is.
WHERE message_id NOT IN (SELECT message_id FROM raw_email_messages WHERE is_test)
