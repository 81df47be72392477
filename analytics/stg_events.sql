-- stg_events: one row per application event in the outbox (what product code published).
-- Grain: event_id. Timestamps are UTC. No payloads or addresses are loaded into the warehouse.
-- status is as of the event's publish or finish: a claim or a requeue in between moves no
-- change marker, so until the event finishes again (or the daily full rebuild) it can show
-- its previous status. The funnel does not read it.
SELECT
    event_id,
    event_type,
    event_version,
    lane,
    occurred_at,
    published_at,
    status,      -- pending | in_flight | done | dead
    resolution,  -- why it is done: sent, ignored (no route), ...
    done_at,
    trace_id,        -- the publisher's request: its W3C trace id, or the id it gave
    correlation_id,  -- the publisher's own request id, if it gave one
    producer         -- the publishing service, if it said
FROM raw_email_outbox
-- A test send's event (templates send-test) is no product event.
WHERE resolution IS DISTINCT FROM 'test'
