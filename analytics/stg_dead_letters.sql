-- stg_dead_letters: what could not be sent, why, and what became of it.
-- Grain: dead_letter_id. message_id is null when the event failed before any message existed
-- (for example an unknown event version). status: open | replayed | discarded | expired |
-- suppressed.
SELECT
    dead_letter_id,
    event_id,
    message_id,
    lane,
    reason,
    error_code,
    attempts,
    run_id,
    status,
    created_at,
    resolved_at
FROM raw_dead_letters
