"""What operators do to a running platform (the CLI and the Dagster jobs call these).

- ``admin``: status, trace, dead letters (list, replay, discard).
- ``erasure``: one person's data out of every table (GDPR Art. 17).
- ``retention``: finished rows deleted past their retention.
- ``alerts``: alert conditions and their notification.
"""
