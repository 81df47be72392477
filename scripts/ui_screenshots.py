"""Screenshots of the Dagster UI on a demo's data, for docs and reviews (not part of the tests).

Usage:
    email-platform demo --home /tmp/demo            # once: runs, logs and assets to look at
    python scripts/ui_screenshots.py --home /tmp/demo --out /tmp/shots

Starts ``dagster-webserver`` on DIR/dagster (with EMAIL_PLATFORM_HOME=DIR, so the code location
reads the demo's database), finds a lane-worker run over GraphQL and writes PNGs with headless
Chromium: the runs list, that run's page (its event log), a failed run's page if there is one,
the ``email_funnel`` asset's overview and checks tabs and ``email_funnel_daily``'s checks.
Needs Debian's Chromium (``apt-get install chromium``). Options: --budget-ms (virtual time the
UI gets to render, default 15000), --window (default 1600,1600).
"""

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from email_platform.local.webserver import WebserverError, WebserverProcess

# Without these Chromium phones home at start-up, which stalls headless runs on this network.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(chromium: str, url: str, path: Path, budget_ms: int, window: str) -> None:
    """One PNG of ``url``; ``budget_ms`` of virtual time lets the React app fetch and render."""
    path.unlink(missing_ok=True)  # so a stale shot is never taken for this one
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        result = subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",  # a fresh profile: no state from earlier shots
                f"--window-size={window}",
                f"--virtual-time-budget={budget_ms}",
                f"--screenshot={path}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if result.returncode != 0 or not path.exists():
        raise RuntimeError(f"chromium failed on {url}:\n{result.stderr[-2000:]}")


def pages(webserver: WebserverProcess) -> list[tuple[str, str]]:
    """(file stem, UI path) for each screenshot, the runs picked over GraphQL."""
    shots = [("runs", "/runs")]
    workers = webserver.runs(job_name="lane_worker_job")
    succeeded = [run for run in workers if run["status"] == "SUCCESS"]
    if workers:
        shots.append(("lane-worker-run", f"/runs/{(succeeded or workers)[0]['runId']}"))
    failed = [run for run in webserver.runs() if run["status"] == "FAILURE"]
    if failed:
        shots.append(("failed-run", f"/runs/{failed[0]['runId']}"))
    shots.append(("email-funnel", "/assets/email_funnel"))
    shots.append(("email-funnel-checks", "/assets/email_funnel?view=checks"))
    # The daily rollup carries the bounce and complaint rate checks (the ones that alert).
    shots.append(("email-funnel-daily-checks", "/assets/email_funnel_daily?view=checks"))
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, required=True, help="the demo's --home")
    parser.add_argument("--out", type=Path, required=True, help="where the PNGs go")
    parser.add_argument("--budget-ms", type=int, default=15000)
    parser.add_argument("--window", default="1600,1600")
    args = parser.parse_args(argv)

    chromium = find_chromium()
    if chromium is None:
        print(
            "chromium not found: install Debian's chromium: apt-get install chromium",
            file=sys.stderr,
        )
        return 2
    home = args.home.resolve()
    dagster_home = home / "dagster"
    if not (dagster_home / "dagster.yaml").exists():
        print(
            f"no Dagster home at {dagster_home}: run `email-platform demo --home {home}` first",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    # The webserver runs in its own session: on SIGTERM unwind, so the context manager stops it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with WebserverProcess(dagster_home, {"EMAIL_PLATFORM_HOME": str(home)}) as webserver:
        try:
            ready = webserver.wait_until_ready(timeout_s=120)
        except WebserverError as error:  # the code location failed to import
            print(f"the code location did not load: {error}", file=sys.stderr)
            return 1
        if not ready:
            print(f"dagster-webserver did not come up; see {webserver.log_path}", file=sys.stderr)
            return 1
        # What clicking "Skip" on the first-visit community dialog does; it would cover the page.
        webserver.graphql("mutation { setNuxSeen }")
        shots = pages(webserver)
        if not any(name == "lane-worker-run" for name, _ in shots):
            print(
                "no lane_worker_job run in this home: screenshots without a run page",
                file=sys.stderr,
            )
        for name, ui_path in shots:
            path = args.out.resolve() / f"{name}.png"
            screenshot(chromium, webserver.url + ui_path, path, args.budget_ms, args.window)
            print(f"{path}  ({ui_path}, {path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
