"""The Kubernetes files, checked as far as they can be without a cluster (docs/kubernetes.md).

Nothing is built, rendered or applied: the files are parsed and compared with the code they
name (settings, commands, modules, routes) and with deploy/dagster.yaml.
"""

import functools
import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

from email_platform.cli import main as email_platform_cli
from email_platform.common import config
from tests.paths import ROOT

DEPLOY = ROOT / "deploy"
DOC = ROOT / "docs" / "kubernetes.md"
SOURCE = ROOT / "email_platform"
VALUES = DEPLOY / "helm" / "values.yaml"
K8S = DEPLOY / "k8s"

#: Peak RSS (MB) of a lane-worker run's whole process tree, measured with `email-platform demo`
#: (docs/kubernetes.md, "Sizing"): the run pods' memory request must cover it.
MEASURED_LANE_WORKER_PEAK_MB = 346
#: The receiver process alone, measured the same way.
MEASURED_RECEIVER_PEAK_MB = 78

SETTING = re.compile(r"EMAIL_PLATFORM_([A-Z0-9_]*[A-Z0-9])")
_READS = (
    re.compile(r'PREFIX\s*\+\s*"([A-Z0-9_]+)"'),  # values.get(PREFIX + "LANES")
    re.compile(r"\{PREFIX\}([A-Z0-9_]+)"),  # f"{PREFIX}EXECUTOR=..."
    re.compile(r'envvar\s*=\s*"EMAIL_PLATFORM_([A-Z0-9_]+)"'),  # click options
    # config.py's checked readers: _seconds(values, "PROVIDER_TIMEOUT_S", 10.0)
    re.compile(r'_(?:rate|seconds|positive_int)\(\s*\w+(?:\(\w*\))?,\s*"([A-Z0-9_]+)"'),
)
#: Suffixes every provider's settings are read with (``own + "BASE_URL"`` in config.py).
_PROVIDER_READS = re.compile(r'own\s*\+\s*"([A-Z0-9_]+)"')


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifests() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in _documents(path)]


def _values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def _instance() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "dagster.yaml").read_text())


def _containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    spec = manifest.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return pod.get("containers", [])


def _receiver() -> tuple[dict[str, Any], dict[str, Any]]:
    deployments = [
        m
        for m in _documents(K8S / "receiver.yaml")
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "email-platform-receiver"
    ]
    assert len(deployments) == 1
    (container,) = _containers(deployments[0])
    return deployments[0], container


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            steps.append((instruction.upper(), rest.strip()))
    return steps


def _exec_form(instruction: str) -> list[str]:
    (value,) = [rest for name, rest in _dockerfile() if name == instruction][-1:]
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(part, str) for part in parsed)
    return parsed


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "K": 1e3 / 2**20, "M": 1e6 / 2**20}
    units["G"] = 1e9 / 2**20
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|K|M|G)?", str(quantity))
    assert match, f"not a memory quantity: {quantity!r}"
    return float(match.group(1)) * units.get(match.group(2) or "", 1 / 2**20)


# --- every file parses ------------------------------------------------------------------------


def test_every_yaml_file_under_deploy_parses_to_mappings():
    files = _yaml_files()
    names = {p.relative_to(DEPLOY).as_posix() for p in files}
    assert {"dagster.yaml", "helm/values.yaml", "k8s/receiver.yaml"} <= names
    for path in files:
        documents = _documents(path)
        assert documents, f"{path} is empty"
        assert all(isinstance(doc, dict) for doc in documents), path
    for manifest in _manifests():
        assert manifest.get("apiVersion") and manifest.get("kind"), manifest
        assert manifest.get("metadata", {}).get("name"), manifest


# --- every setting named is one the code reads ------------------------------------------------


@functools.cache
def _source_reads() -> tuple[frozenset[str], frozenset[str]]:
    direct: set[str] = set()
    per_provider: set[str] = set()
    for path in SOURCE.rglob("*.py"):
        text = path.read_text()
        for pattern in _READS:
            direct.update(pattern.findall(text))
        per_provider.update(_PROVIDER_READS.findall(text))
    return frozenset(direct), frozenset(per_provider)


def _is_read(suffix: str) -> bool:
    """``EMAIL_PLATFORM_<suffix>`` is read: by name, as a provider's base URL/key/option, or
    as a webhook secret its provider's verifier looks up."""
    direct, per_provider = _source_reads()
    if suffix in direct:
        return True
    for provider in config.PROVIDERS:
        own = provider.upper() + "_"
        if not suffix.startswith(own):
            continue
        rest = suffix[len(own) :]
        if "_WEBHOOK_" in "_" + rest:
            modules = list((SOURCE / "webhooks").glob("*.py"))
            key = suffix.lower()
        else:
            if rest in per_provider:
                return True
            modules = [SOURCE / "providers" / f"{provider}.py"]
            key = rest.lower()
        return any(f'"{key}"' in m.read_text() for m in modules if m.exists())
    return False


def _named_settings() -> dict[str, set[str]]:
    named: dict[str, set[str]] = {}
    for path in [*sorted(p for p in DEPLOY.rglob("*") if p.is_file()), DOC]:
        for suffix in SETTING.findall(path.read_text()):
            named.setdefault(suffix, set()).add(path.relative_to(ROOT).as_posix())
    return named


def test_the_setting_check_tells_read_names_from_unread_ones():
    assert _is_read("DATABASE_URL") and _is_read("LANES")
    assert _is_read("POSTMARK_API_KEY") and _is_read("MAILGUN_DOMAIN")
    assert _is_read("POSTMARK_WEBHOOK_USER")
    assert not _is_read("NOT_A_SETTING")
    assert not _is_read("MAILGUN_NOT_AN_OPTION")
    assert not _is_read("POSTMARK_WEBHOOK_NOT_A_SECRET")


def test_every_setting_in_the_deploy_files_and_the_doc_is_read_by_the_code():
    named = _named_settings()
    assert {"DATABASE_URL", "LANES", "HOME", "WAREHOUSE"} <= set(named), sorted(named)
    unread = {f"EMAIL_PLATFORM_{s}": sorted(where) for s, where in named.items() if not _is_read(s)}
    assert not unread, f"named but never read by email_platform/: {unread}"


def test_the_lane_settings_shipped_in_the_configmap_are_valid_lane_overrides():
    from email_platform.resources.lanes import LanePolicy

    (configmap,) = [m for m in _documents(K8S / "config.yaml") if m["kind"] == "ConfigMap"]
    policy = LanePolicy(overrides_json=configmap["data"]["EMAIL_PLATFORM_LANES"])
    limits = {
        item["value"]: item["limit"]
        for item in _instance()["run_queue"]["tag_concurrency_limits"]
        if item["key"] == "email/lane"
    }
    for lane in ("critical", "transactional", "bulk"):
        lane_config = policy.config_for(lane)
        assert lane_config.workers >= 1
        if lane in limits:  # room for each worker's successor, which starts before it ends
            assert lane_config.workers + 1 <= limits[lane], lane


# --- the image's entry points exist -----------------------------------------------------------


def _dagster_code_server_start() -> click.Command:
    from dagster._cli import create_dagster_cli

    cli = create_dagster_cli()
    context = click.Context(cli)
    group = cli.get_command(context, "code-server")
    assert isinstance(group, click.Group)
    command = group.get_command(context, "start")
    assert command is not None
    return command


def test_the_dockerfile_builds_a_non_root_python_311_image_of_this_package():
    steps = _dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    users = [rest for name, rest in steps if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    installs = [rest for name, rest in steps if name == "RUN" and "pip install" in rest]
    assert len(installs) == 1
    extras = re.findall(r'"\.\[([a-z0-9_,-]+)\]"', installs[0])
    assert extras, installs[0]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in extras[0].split(","):
        assert extra in declared["optional-dependencies"], extra
    assert "dagster" in extras[0].split(","), "the image runs the Dagster side"
    dagster = next(
        d
        for d in declared["optional-dependencies"]["dagster"]
        if d.startswith("dagster-postgres==")
    )
    assert f'"dagster-k8s=={dagster.split("==")[1]}"' in installs[0]
    copied = " ".join(rest for name, rest in steps if name == "COPY")
    for needed in ("pyproject.toml", "README.md", "analytics", "email_platform"):
        assert needed in copied, needed


def test_the_dockerfile_cmd_is_the_code_server_of_the_definitions_module():
    assert _exec_form("ENTRYPOINT") == ["/usr/bin/tini", "--"]
    cmd = _exec_form("CMD")
    assert cmd[:3] == ["dagster", "code-server", "start"]
    context = _dagster_code_server_start().make_context("start", cmd[3:])
    assert context.params["host"] == "0.0.0.0"
    assert context.params["port"] == 4000
    module = importlib.import_module(context.params["module_name"])
    from dagster import Definitions

    assert any(isinstance(value, Definitions) for value in vars(module).values())
    result = CliRunner().invoke(_dagster_code_server_start(), ["--help"])
    assert result.exit_code == 0 and "--module-name" in result.output


def test_email_platform_is_the_console_script_of_the_cli(monkeypatch, capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attribute = scripts["email-platform"].partition(":")
    # The console script is the launcher that runs the click group (and names a missing extra).
    launcher = getattr(importlib.import_module(module), attribute)
    calls = []
    monkeypatch.setattr(email_platform_cli, "main", lambda **kwargs: calls.append(kwargs))
    launcher(["status", "--json"])
    assert calls == [{"args": ["status", "--json"]}]


def _command_lines() -> list[list[str]]:
    lines = []
    for manifest in _manifests():
        for container in _containers(manifest):
            argv = [*container.get("command", []), *container.get("args", [])]
            if argv and argv[0] == "email-platform":
                lines.append(argv)
    for text in ((DEPLOY / "Dockerfile").read_text(), DOC.read_text()):
        for span in re.findall(r"`(email-platform [^`]*)`", text):
            if "..." not in span:
                lines.append(shlex.split(span))
    return lines


@pytest.mark.parametrize(
    "argv",
    [*_command_lines(), ["email-platform", "webhooks", "serve", "--no-such-flag"]],
    ids=" ".join,
)
def test_every_email_platform_command_line_in_the_files_parses(argv):
    command: click.Command = email_platform_cli
    rest = argv[1:]
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"no command {rest[0]!r} in {' '.join(argv)}"
        command, rest = sub, rest[1:]
    assert not isinstance(command, click.Group), f"{' '.join(argv)} names a group"
    result = CliRunner().invoke(email_platform_cli, [*argv[1 : len(argv) - len(rest)], "--help"])
    assert result.exit_code == 0, result.output
    if "--no-such-flag" in rest:  # the check itself: an unknown flag must be refused
        with pytest.raises(click.UsageError):
            command.make_context(command.name or "", list(rest))
        return
    command.make_context(command.name or "", list(rest))  # flags and values parse


def test_the_manifests_list_the_command_lines_the_doc_relies_on():
    lines = {" ".join(argv[:3]) for argv in _command_lines()}
    assert {
        "email-platform webhooks serve",
        "email-platform db upgrade",
        "email-platform workers stop",
    } <= lines


# --- the chart's values agree with deploy/dagster.yaml and the image --------------------------


def test_the_run_queue_in_values_is_deploy_dagster_yamls():
    daemon = _values()["dagsterDaemon"]
    coordinator = daemon["runCoordinator"]
    assert coordinator["enabled"] is True and coordinator["type"] == "QueuedRunCoordinator"
    queued = coordinator["config"]["queuedRunCoordinator"]
    queue = _instance()["run_queue"]
    assert queued["maxConcurrentRuns"] == queue["max_concurrent_runs"]
    assert queued["dequeueIntervalSeconds"] == queue["dequeue_interval_seconds"]
    assert queued["dequeueUseThreads"] == queue["dequeue_use_threads"]

    def limits(items: list[dict[str, Any]]) -> list[tuple[str, Any, int]]:
        return sorted((i["key"], i.get("value"), i["limit"]) for i in items)

    assert limits(queued["tagConcurrencyLimits"]) == limits(queue["tag_concurrency_limits"])
    assert limits(queue["tag_concurrency_limits"])  # not vacuously equal


def test_run_monitoring_sensors_retention_and_storage_match_deploy_dagster_yaml():
    values, instance = _values(), _instance()
    monitoring = values["dagsterDaemon"]["runMonitoring"]
    assert monitoring["enabled"] is instance["run_monitoring"]["enabled"] is True
    assert monitoring["pollIntervalSeconds"] == instance["run_monitoring"]["poll_interval_seconds"]
    assert monitoring["startTimeoutSeconds"] == instance["run_monitoring"]["start_timeout_seconds"]
    sensors = values["dagsterDaemon"]["sensors"]
    assert sensors["useThreads"] == instance["sensors"]["use_threads"]
    assert sensors["numWorkers"] == instance["sensors"]["num_workers"]
    purge = values["retention"]["sensor"]["purgeAfterDays"]
    for status, days in instance["retention"]["sensor"]["purge_after_days"].items():
        assert purge[status] == days, status
    assert values["telemetry"]["enabled"] is instance["telemetry"]["enabled"] is False
    assert values["postgresql"]["enabled"] is False
    # The chart renders dagster-postgres's own storage: the daemon there opens a connection
    # per read and write (docs/kubernetes.md); the scheme is the same.
    storage = instance["storage"]["custom"]
    assert storage["class"] == "HeldPostgresStorage"
    scheme = storage["config"]["postgres_db"]["scheme"]
    assert values["postgresql"]["postgresqlScheme"] == scheme


def test_the_code_location_is_our_image_serving_the_dockerfiles_module_and_port():
    values = _values()
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    user = values["dagster-user-deployments"]
    assert user["enabled"] is True
    (deployment,) = user["deployments"]
    cmd = _exec_form("CMD")
    module = cmd[cmd.index("-m") + 1]
    assert deployment["codeServerArgs"] == ["-m", module]
    assert deployment["port"] == int(cmd[cmd.index("-p") + 1])
    # The code server's resources must not be merged into the run pods' (values.yaml).
    assert deployment["includeConfigInLaunchedRuns"] == {"enabled": False}
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert launcher["envSecrets"] == deployment["envSecrets"]
    assert launcher["envConfigMaps"] == deployment["envConfigMaps"]


# --- resources, probes and secrets ------------------------------------------------------------


def _check_resources(resources: dict[str, Any], at_least_mb: float) -> None:
    requests = resources["requests"]
    assert requests.get("cpu") and requests.get("memory"), resources
    assert _mebibytes(requests["memory"]) * 2**20 / 1e6 >= at_least_mb, resources
    limit = resources.get("limits", {}).get("memory")
    assert limit is not None and _mebibytes(limit) >= _mebibytes(requests["memory"]), resources


def test_runs_the_code_server_and_the_receiver_request_what_was_measured():
    assert _mebibytes("512Mi") == 512 and _mebibytes("1Gi") == 1024
    values = _values()
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    _check_resources(launcher["resources"], MEASURED_LANE_WORKER_PEAK_MB)
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    _check_resources(deployment["resources"], 192)
    _, container = _receiver()
    _check_resources(container["resources"], MEASURED_RECEIVER_PEAK_MB)
    for manifest in _manifests():  # every container in the manifests, the Jobs too
        for each in _containers(manifest):
            assert each["resources"]["requests"]["memory"], manifest["metadata"]["name"]
    with pytest.raises(AssertionError):
        _check_resources({"requests": {"cpu": "1", "memory": "128Mi"}}, 346)


def test_the_receiver_runs_two_replicas_probed_on_a_route_it_serves():
    import asyncio

    import httpx
    from sqlalchemy import create_engine

    from email_platform.webhooks.receiver import create_receiver_app

    deployment, container = _receiver()
    assert deployment["spec"]["replicas"] == 2
    argv = container["args"]
    port = int(argv[argv.index("--port") + 1])
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    app = create_receiver_app(create_engine("sqlite://"), settings={})

    async def status(path: str) -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as client:
            return (await client.get(path)).status_code

    for probe in (container["readinessProbe"], container["livenessProbe"]):
        get = probe["httpGet"]
        assert ports.get(get["port"], get["port"]) == port
        assert asyncio.run(status(get["path"])) == 200
    assert asyncio.run(status("/no-such-route")) == 404
    (service,) = [m for m in _documents(K8S / "receiver.yaml") if m["kind"] == "Service"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)


def _secret_names() -> dict[str, set[str]]:
    secrets = [m for m in _documents(K8S / "secrets.example.yaml") if m["kind"] == "Secret"]
    return {s["metadata"]["name"]: set(s.get("stringData", {})) for s in secrets}


def test_secrets_are_referenced_by_name_and_the_example_holds_placeholders_only():
    secrets = _secret_names()
    for secret in _documents(K8S / "secrets.example.yaml"):
        for key, value in secret.get("stringData", {}).items():
            assert re.search(r"<[^>]+>", value), f"{key} is not a placeholder"
        assert "data" not in secret
    configmaps = {m["metadata"]["name"] for m in _manifests() if m["kind"] == "ConfigMap"}
    referenced: set[str] = set()
    for manifest in _manifests():
        if manifest["kind"] == "Secret":
            continue
        for container in _containers(manifest):
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    referenced.add(source["secretRef"]["name"])
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in configmaps
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], ref
                    referenced.add(ref["name"])
                else:  # inline values only for what is not a secret
                    assert not re.search(r"PASSWORD|SECRET|KEY|TOKEN|DATABASE_URL", env["name"])
    values = _values()
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    referenced.update(s["name"] for s in launcher["envSecrets"])
    assert "postgresql-password" in secrets[values["global"]["postgresqlSecretName"]]
    assert referenced and referenced <= set(secrets), referenced - set(secrets)
    for name in ("receiver.yaml", "config.yaml", "migrate-job.yaml", "workers-stop-job.yaml"):
        text = (K8S / name).read_text()
        assert not re.search(r"postgres(ql)?(\+\w+)?://[^<\s]*:[^<\s]*@", text), name
