"""One observable asset per lane for what its send runs did: ``email_platform/sends_<lane>``.

A send run observes the sends it made since its last observation. Observed under the one
``email_messages`` key, three lanes' observations were plotted as one line (a bulk run's 293
followed by a critical run's 57 read as a collapse) and the asset's latest metadata was the
last lane's alone. Each lane's own key gives each lane its own plot and its own latest value;
each depends on ``email_messages``, the table those sends write, for lineage.
"""

from dagster import AssetSpec

from email_platform.assets.keys import ASSET_GROUP, asset_key
from email_platform.common.lanes import LANES


def sends_key_name(lane: str) -> str:
    """The asset a lane's send runs observe: ``sends_<lane>`` under the platform's prefix."""
    return f"sends_{lane}"


lane_sends = [
    AssetSpec(
        asset_key(sends_key_name(lane.value)),
        group_name=ASSET_GROUP,
        description=(
            f"What the {lane.value} lane's send runs did: each observation is one run's "
            "messages sent, dead-lettered, retried and suppressed since its previous "
            "observation (plotted over time on this page). Observed, never materialized."
        ),
        deps=[asset_key("email_messages")],
        kinds={"sql"},
    )
    for lane in LANES
]
