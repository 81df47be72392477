"""The benchmark and the generator run end to end at a tiny size (a smoke test, not timed)."""

from bench.analytics import run


def test_benchmark_smoke(tmp_path):
    results = run(messages=500, increment=100, rounds=1, days=2, workdir=tmp_path)
    steps = {r["step"].split(" ")[0]: r for r in results}
    assert steps["full"]["funnel_rows"] == 500
    assert steps["full"]["events_rows"] > 500 * 3
    assert steps["incremental"]["funnel_rows"] == 600
    assert 100 <= steps["incremental"]["messages_rebuilt"] <= 200
    assert steps["re-run,"]["loaded"] == 0
