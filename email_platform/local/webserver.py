"""``dagster-webserver`` on a local Dagster home, and a few GraphQL reads of what it serves.

For the end-to-end tests and the UI screenshot script: the same process a user opens in a
browser, asked over the same GraphQL API the UI uses (the schema of dagster-graphql 1.13).
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from email_platform.local.dagster_home import prepare_home, wait_for

# The queries below are checked against dagster-graphql 1.13's schema (dagster is pinned).
_LOCATION_QUERY = """
query Location { workspaceOrError {
  __typename
  ... on Workspace { locationEntries { name loadStatus locationOrLoadError {
    __typename
    ... on PythonError { message }
    ... on RepositoryLocation { repositories {
      jobs { name } sensors { name } schedules { name }
    } }
  } } }
  ... on PythonError { message }
} }
"""

_DESCRIPTIONS_QUERY = """
query Descriptions { workspaceOrError {
  __typename
  ... on Workspace { locationEntries { locationOrLoadError {
    __typename
    ... on PythonError { message }
    ... on RepositoryLocation { repositories {
      jobs { name description } sensors { name description } schedules { name description }
      assetNodes { assetKey { path } description assetChecksOrError {
        __typename
        ... on AssetChecks { checks { name description } }
      } }
    } }
  } } }
  ... on PythonError { message }
} }
"""

_RUNS_QUERY = """
query Runs($filter: RunsFilter, $limit: Int) { runsOrError(filter: $filter, limit: $limit) {
  __typename
  ... on Runs { results {
    runId jobName status tags { key value } creationTime startTime endTime
  } }
  ... on Error { message }
} }
"""

_LOGS_QUERY = """
query Logs($runId: ID!, $cursor: String) { logsForRun(runId: $runId, afterCursor: $cursor) {
  __typename
  ... on EventConnection {
    events {
      __typename ... on MessageEvent { message } ... on ErrorEvent { error { message } }
    }
    cursor hasMore
  }
  ... on Error { message }
} }
"""

# The value fields of the metadata types the platform's assets and checks record.
_ENTRY_FRAGMENT = """
fragment Entry on MetadataEntry {
  __typename label
  ... on FloatMetadataEntry { floatValue floatRepr }
  ... on IntMetadataEntry { intRepr }
  ... on BoolMetadataEntry { boolValue }
  ... on TextMetadataEntry { text }
  ... on TimestampMetadataEntry { timestamp }
  ... on PathMetadataEntry { path }
  ... on UrlMetadataEntry { url }
  ... on MarkdownMetadataEntry { mdStr }
  ... on JsonMetadataEntry { jsonString }
  ... on TableMetadataEntry { table { records } }
}
"""

_MATERIALIZATION_QUERY = (
    """
query Latest($key: AssetKeyInput!) { assetOrError(assetKey: $key) {
  __typename
  ... on Asset { assetMaterializations(limit: 1) { metadataEntries { ...Entry } } }
  ... on AssetNotFoundError { message }
} }
"""
    + _ENTRY_FRAGMENT
)

_CHECKS_QUERY = (
    """
query Checks($key: AssetKeyInput!) { assetNodes(assetKeys: [$key]) { assetChecksOrError {
  __typename
  ... on AssetChecks { checks { name executionForLatestMaterialization {
    runId status evaluation { success severity metadataEntries { ...Entry } }
  } } }
  ... on Error { message }
} } }
"""
    + _ENTRY_FRAGMENT
)


class WebserverError(RuntimeError):
    """The webserver answered with GraphQL errors, or a location failed to load."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _key(asset_key: str) -> dict[str, list[str]]:
    return {"path": asset_key.split("/")}


def _ok(result: dict[str, Any], typename: str) -> dict[str, Any]:
    """``result`` if it is the ``typename`` branch of an ``...OrError`` union, else raise."""
    if result["__typename"] != typename:
        raise WebserverError(f"{result['__typename']}: {result.get('message', result)}")
    return result


def metadata_value(entry: Mapping[str, Any]) -> Any:
    """A metadata entry (``Entry`` fragment) as a Python value; None for unknown types."""
    kind = entry["__typename"]
    if kind == "FloatMetadataEntry":
        # floatValue is null for NaN and infinities; the repr keeps them.
        value = entry["floatValue"]
        return float(entry["floatRepr"]) if value is None else value
    if kind == "IntMetadataEntry":
        return int(entry["intRepr"])  # intValue is null beyond 32 bits
    if kind == "TimestampMetadataEntry":
        return datetime.fromtimestamp(entry["timestamp"], UTC)
    if kind == "JsonMetadataEntry":
        return json.loads(entry["jsonString"])
    if kind == "TableMetadataEntry":
        return [json.loads(record) for record in entry["table"]["records"]]
    for field in ("boolValue", "text", "path", "url", "mdStr"):
        if field in entry:
            return entry[field]
    return None


def _metadata(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {entry["label"]: metadata_value(entry) for entry in entries}


class WebserverProcess:
    """``dagster-webserver`` in a child process on a free loopback port, for ``home``'s data.

    ``env`` reaches the code location it loads (e.g. ``EMAIL_PLATFORM_HOME``).
    """

    def __init__(
        self,
        home: Path,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.home = home
        self.env = {**os.environ, **(env or {}), "DAGSTER_HOME": str(home)}
        self.log_path = log_path or home / "webserver.log"
        self.port = port or _free_port()
        self.process: subprocess.Popen | None = None
        self._client = httpx.Client(timeout=30.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "WebserverProcess":
        workspace = prepare_home(self.home)
        # Create the instance's storage first, as DaemonProcess does: on a fresh home the
        # webserver would otherwise race anyone else opening it to run the first migrations.
        from dagster import DagsterInstance

        with DagsterInstance.from_config(str(self.home)):
            pass
        if self._client.is_closed:
            self._client = httpx.Client(timeout=30.0)
        script = Path(sys.executable).with_name("dagster-webserver")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "dagster_webserver"]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*command, "-h", "127.0.0.1", "-p", str(self.port), "-w", str(workspace)],
            env=self.env,
            cwd=str(self.home),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_until_ready(self, timeout_s: float = 120.0) -> bool:
        """Block until the server answers and every code location is loaded.

        False if that takes longer than ``timeout_s`` or the process exits; raises
        ``WebserverError`` if a location loaded with an error (waiting would not help).
        """

        def serving() -> bool:
            if not self.alive():
                return False
            try:
                return self._client.get(f"{self.url}/server_info").status_code == 200
            except httpx.TransportError:
                return False

        def loaded() -> bool:
            entries = self._location_entries() if self.alive() else []
            return bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)

        deadline = time.monotonic() + timeout_s
        if not wait_for(serving, timeout_s, interval_s=0.5):
            return False
        if not wait_for(loaded, max(0.0, deadline - time.monotonic()), interval_s=0.5):
            return False
        for entry in self._location_entries():
            _ok(entry["locationOrLoadError"], "RepositoryLocation")
        return True

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST ``query`` to ``/graphql``; its ``data``, or ``WebserverError`` on any error."""
        response = self._client.post(
            f"{self.url}/graphql", json={"query": query, "variables": variables or {}}
        )
        try:
            body = response.json()
        except ValueError:
            response.raise_for_status()
            raise
        if body.get("errors"):
            messages = "; ".join(error.get("message", str(error)) for error in body["errors"])
            raise WebserverError(f"GraphQL errors: {messages}")
        response.raise_for_status()
        return body["data"]

    def _location_entries(self) -> list[dict[str, Any]]:
        workspace = _ok(self.graphql(_LOCATION_QUERY)["workspaceOrError"], "Workspace")
        return workspace["locationEntries"]

    def definitions(self) -> dict[str, list[str]]:
        """Names of the jobs, sensors and schedules every loaded location serves.

        Dagster's hidden asset jobs (``__ASSET_JOB``...) are left out.
        """
        found: dict[str, list[str]] = {"jobs": [], "sensors": [], "schedules": []}
        for entry in self._location_entries():
            location = _ok(entry["locationOrLoadError"], "RepositoryLocation")
            for repository in location["repositories"]:
                for kind, names in found.items():
                    names.extend(
                        item["name"]
                        for item in repository[kind]
                        if not item["name"].startswith("__")
                    )
        return {kind: sorted(names) for kind, names in found.items()}

    def descriptions(self) -> dict[str, dict[str, str | None]]:
        """What the UI shows beside each job, sensor, schedule, asset and asset check.

        Keyed by kind, then by name (an asset by its slash-joined key, a check as
        ``asset:check``); Dagster's hidden asset jobs are left out.
        """
        workspace = _ok(self.graphql(_DESCRIPTIONS_QUERY)["workspaceOrError"], "Workspace")
        found: dict[str, dict[str, str | None]] = {
            kind: {} for kind in ("jobs", "sensors", "schedules", "assets", "checks")
        }
        for entry in workspace["locationEntries"]:
            location = _ok(entry["locationOrLoadError"], "RepositoryLocation")
            for repository in location["repositories"]:
                for kind in ("jobs", "sensors", "schedules"):
                    for item in repository[kind]:
                        if not item["name"].startswith("__"):
                            found[kind][item["name"]] = item["description"]
                for node in repository["assetNodes"]:
                    key = "/".join(node["assetKey"]["path"])
                    found["assets"][key] = node["description"]
                    checks = node["assetChecksOrError"]
                    for check in checks.get("checks", []) if checks else []:
                        found["checks"][f"{key}:{check['name']}"] = check["description"]
        return found

    def runs(self, job_name: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first: runId, jobName, status, tags (as a dict) and times (epoch seconds)."""
        variables = {"filter": {"pipelineName": job_name} if job_name else {}, "limit": limit}
        result = _ok(self.graphql(_RUNS_QUERY, variables)["runsOrError"], "Runs")
        return [
            {**run, "tags": {tag["key"]: tag["value"] for tag in run["tags"]}}
            for run in result["results"]
        ]

    def run_log_messages(self, run_id: str) -> list[str]:
        """The non-empty messages of the run's event log, in order (all pages).

        A failure's message ends with its error's (the UI shows that in a separate pane).
        """
        messages: list[str] = []
        cursor = None
        while True:
            data = self.graphql(_LOGS_QUERY, {"runId": run_id, "cursor": cursor})
            page = _ok(data["logsForRun"], "EventConnection")
            for event in page["events"]:
                error = event.get("error")
                message = event.get("message", "")
                if error:
                    message = f"{message} {error['message'].strip()}"
                if message:
                    messages.append(message)
            if not page["hasMore"]:
                return messages
            cursor = page["cursor"]

    def latest_asset_metadata(self, asset_key: str) -> dict[str, Any]:
        """The metadata of the asset's latest materialization ({} if never materialized).

        ``asset_key`` is slash-separated for multi-part keys.
        """
        data = self.graphql(_MATERIALIZATION_QUERY, {"key": _key(asset_key)})
        events = _ok(data["assetOrError"], "Asset")["assetMaterializations"]
        return _metadata(events[0]["metadataEntries"]) if events else {}

    def asset_checks(self, asset_key: str) -> list[dict[str, Any]]:
        """The asset's checks with their execution for its latest materialization.

        Each: name, status (None if not run; else SUCCEEDED, FAILED, ...), runId, success,
        severity (ERROR/WARN) and metadata.
        """
        nodes = self.graphql(_CHECKS_QUERY, {"key": _key(asset_key)})["assetNodes"]
        checks: list[dict[str, Any]] = []
        for node in nodes:
            for check in _ok(node["assetChecksOrError"], "AssetChecks")["checks"]:
                execution = check["executionForLatestMaterialization"] or {}
                evaluation = execution.get("evaluation") or {}
                checks.append(
                    {
                        "name": check["name"],
                        "status": execution.get("status"),
                        "runId": execution.get("runId"),
                        "success": evaluation.get("success"),
                        "severity": evaluation.get("severity"),
                        "metadata": _metadata(evaluation.get("metadataEntries", [])),
                    }
                )
        return checks

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then kill the process group (the webserver's code server lives there)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()
        self._client.close()
        self.process = None

    def __enter__(self) -> "WebserverProcess":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
