"""The HTTP client comparison (``python -m bench.http_clients``) keeps working: each client sends
every request once through the real sandbox, and the figures reach the JSON. No timing is
asserted: the bench is run by hand, its figures are in bench/README.md."""

import json

from bench.http_clients import main


def test_each_client_sends_every_request_and_reports_its_figures(tmp_path):
    out = tmp_path / "clients.json"
    code = main(
        [
            *("--latency-ms", "5", "--requests", "40", "--in-flight", "8"),
            *("--clients", "threads,event-loop,httpx-async", "--json", str(out)),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["settings"] == {"latency_ms": 5.0, "requests": 40, "in_flight": 8}
    rows = {row["client"]: row for row in report["clients"]}
    assert set(rows) == {"threads", "event-loop", "httpx-async"}
    for row in rows.values():
        assert row["sent"] == 40
        assert row["requests_per_s"] > 0 and row["cpu_us_per_request"] > 0
