"""The send path without Dagster: claim a batch, prepare its messages, send, record, settle.

``batch.BatchSender`` is one attempt at a batch; ``worker.LaneWorker`` keeps claiming batches
for a lane; ``retry`` is the backoff both use; ``leases`` renews their claims while they run.
"""
