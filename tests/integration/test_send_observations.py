"""Each lane's sends are observed on its own asset (``email_platform/sends_<lane>``), on SQLite
and PostgreSQL: observed under the one ``email_messages`` key, three lanes' runs were plotted as
one line (a bulk run's 293 and then a critical run's 57 read as sends collapsing) and the
asset's latest metadata was the last lane's alone."""

from dagster import AssetKey, DagsterInstance

from email_platform.definitions import build_definitions
from tests.support import publish_one, run_send, signup


def _observed(instance: DagsterInstance, run_id: str) -> list[tuple[str, dict]]:
    found = []
    for record in instance.all_logs(run_id):
        if record.is_dagster_event and record.dagster_event.event_type_value == "ASSET_OBSERVATION":
            observation = record.dagster_event.asset_observation_data.asset_observation
            values = {key: value.value for key, value in observation.metadata.items()}
            found.append((observation.asset_key.to_user_string(), values))
    return found


def test_each_lanes_sends_are_observed_on_its_own_asset(engine, database_url, sandbox):
    welcomes = [signup(engine, f"u{i}") for i in range(3)]
    digests = [
        publish_one(
            engine,
            event_type="digest.ready",
            aggregate_id=f"d{i}",
            payload={"email": f"d{i}@example.org", "first_name": "Dee", "highlights": ["a"]},
        )
        for i in range(5)
    ]
    instance = DagsterInstance.ephemeral()
    bulk = run_send(database_url, sandbox.base_url, "bulk", digests, instance=instance)
    sent = run_send(database_url, sandbox.base_url, "transactional", welcomes, instance=instance)
    assert bulk.success and sent.success
    assert _observed(instance, bulk.run_id) == [
        (
            "email_platform/sends_bulk",
            {
                "lane": "bulk",
                "messages_sent": 5,
                "dead_letters_recorded": 0,
                "transient_failures": 0,
                "messages_suppressed": 0,
            },
        )
    ]
    ((asset, values),) = _observed(instance, sent.run_id)
    assert asset == "email_platform/sends_transactional" and values["messages_sent"] == 3
    # Each lane's latest observation is its own: the bulk lane's is not the last run's.
    for lane, count in (("bulk", 5), ("transactional", 3)):
        (record,) = instance.fetch_observations(
            AssetKey(["email_platform", f"sends_{lane}"]), limit=5
        ).records
        metadata = record.asset_observation.metadata
        assert metadata["messages_sent"].value == count
    assert not instance.fetch_observations(
        AssetKey(["email_platform", "email_messages"]), limit=5
    ).records


def test_every_lane_has_its_sends_asset_beside_the_table_it_writes():
    defs = build_definitions()
    graph = defs.resolve_asset_graph()
    for lane in ("critical", "transactional", "bulk"):
        key = AssetKey(["email_platform", f"sends_{lane}"])
        assert graph.has(key)
        assert graph.get(key).parent_keys == {AssetKey(["email_platform", "email_messages"])}


def test_a_batch_run_holding_dead_letters_fails_cleanly_with_what_to_do(
    engine, database_url, sandbox
):
    """The batch op (``workers: 0``) fails on purpose to hold its dead letters: the failure is
    our description and metadata, with no frame of ours under it but the op's re-raise."""
    good = signup(engine, "ok")
    bad = signup(engine, "no", email="no+reject@example.com")
    result = run_send(database_url, sandbox.base_url, "transactional", [good, bad])
    assert not result.success
    (event,) = result.get_step_failure_events()
    failure = event.step_failure_data
    assert failure.user_failure_data.label == "intentional-failure"
    assert failure.user_failure_data.description.startswith(
        "1 message(s) of this run are in dead_letters ("
    )
    assert "re-execute this run from failure" in failure.user_failure_data.description
    metadata = failure.user_failure_data.metadata
    assert metadata["open_dead_letters"].value == 1 and metadata["dead_letter_ids"].value
    ours = [frame for frame in failure.error.stack if "email_platform" in frame]
    assert len(ours) == 1 and "raise failure.with_traceback(None)" in ours[0], ours
    assert failure.error.cause is None and failure.error.context is None
