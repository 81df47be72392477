"""What every layer stands on: plain, small, no I/O of its own.

- ``errors``: the error tree; ``classify``: retry or dead letter, decided purely.
- ``config``: every ``EMAIL_PLATFORM_*`` setting, read here only.
- ``lanes``: the priority lanes and their settings.
- ``ids`` (ULIDs), ``timeutil`` (UTC), ``text`` (storable text), ``tags`` (provider tag values).
"""
