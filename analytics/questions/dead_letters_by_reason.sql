-- Why do messages end up in dead letters, and what became of them?
-- One row per reason x lane; open ones still wait for an operator (email-platform dlq).
SELECT
    reason,
    lane,
    count(*) AS dead_letters,
    count(*) FILTER (WHERE status = 'open') AS open,
    count(*) FILTER (WHERE status = 'replayed') AS replayed,
    count(*) FILTER (WHERE status = 'discarded') AS discarded,
    count(*) FILTER (WHERE status IN ('expired', 'suppressed')) AS closed_otherwise,
    min(created_at) FILTER (WHERE status = 'open') AS oldest_open_at,
    median((epoch_ms(resolved_at) - epoch_ms(created_at)) / 1000.0) AS time_to_resolve_p50_s
FROM stg_dead_letters
GROUP BY reason, lane
ORDER BY open DESC, dead_letters DESC, reason, lane
