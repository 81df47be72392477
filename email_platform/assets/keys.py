"""Every asset of the platform lives under one key prefix and in one group, so its keys cannot
collide with a project's own when the definitions are merged (docs/dagster-component.md)."""

from dagster import AssetKey

#: The first part of every asset key, and the one asset group.
ASSET_PREFIX = "email_platform"
ASSET_GROUP = "email_platform"


def asset_key(name: str) -> AssetKey:
    """``email_platform/<name>``: a table's asset, named after the table."""
    return AssetKey([ASSET_PREFIX, name])
