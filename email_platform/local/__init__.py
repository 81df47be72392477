"""Running the platform on one machine without a deployment: the demo, a local Dagster home
with its daemon, and replays executed in-process (``dlq replay --inline``).
"""
