"""docker-compose.yml and the Dockerfile: valid Compose, and the deployment contract the containers rely on.

No Docker engine is needed. The file is validated against the Compose Specification's JSON schema, vendored in
tests/data/compose-spec.json (origin in compose-spec.README.md beside it), before and after interpolation with
the defaults; where a Compose CLI is installed (`docker-compose`, or the `docker compose` plugin) its own
`config` must accept the file too. The contract checks read the file as Compose would run it with an empty
environment (every `${VAR:-default}` at its default), except where a test sets variables on purpose.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "data" / "compose-spec.json"

PDSERVE_SERVICES = {"pki", "model-fetch", "gateway", "prefill", "decode", "prefill-gpu", "decode-gpu"}
ONE_SHOT_SERVICES = {"pki", "model-fetch"}
SERVING_SERVICES = PDSERVE_SERVICES - ONE_SHOT_SERVICES  # long-running, so health-checked
WORKER_SERVICES = {"prefill", "decode", "prefill-gpu", "decode-gpu"}
GPU_WORKER_SERVICES = {"prefill-gpu", "decode-gpu"}
GPU_RESERVATION = [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


# ---------------------------------------------------------------------------------------------------------------
# Reading the files

# $$ (a literal $), ${NAME}, ${NAME:-default}, ${NAME-default}, $NAME: the forms of Compose interpolation
# this file may use. Anything else that starts with $ fails the test instead of passing through unread.
_INTERPOLATION = re.compile(r"\$(?:(?P<escaped>\$)"
                            r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"
                            r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
                            r"|(?P<invalid>))")


def _interpolate_str(text: str, env: dict[str, str]) -> str:
    def replace(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("invalid") is not None:
            raise ValueError(f"unsupported interpolation at {text[m.start():m.start() + 20]!r} in {text!r}")
        name = m.group("braced") or m.group("named")
        value = env.get(name)
        op = m.group("op")
        if op == ":-" and not value:
            return m.group("default")
        if op == "-" and value is None:
            return m.group("default")
        return value or ""

    return _INTERPOLATION.sub(replace, text)


def _interpolate(node, env: dict[str, str]):
    """Compose's interpolation of every string value (mapping keys are not interpolated)."""
    if isinstance(node, str):
        return _interpolate_str(node, env)
    if isinstance(node, dict):
        return {k: _interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env) for v in node]
    return node


@lru_cache(maxsize=1)
def _raw() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _compose(**env: str) -> dict:
    """The file as Compose resolves it with exactly `env` set."""
    return _interpolate(copy.deepcopy(_raw()), env)


@lru_cache(maxsize=1)
def _schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


def _schema_errors(document: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(_schema())
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(document))


def _argv(service: dict) -> list[str]:
    """The process a pdserve service's container runs: the image's ENTRYPOINT is `pdserve` unless overridden.

    A `sh -c SCRIPT` entrypoint is unwrapped to the words of SCRIPT from its `exec` on (what runs after the
    `export NAME=VALUE &&` steps of _exports), as the shell would see them before expanding variables.
    """
    entrypoint = service.get("entrypoint")
    command = service.get("command") or []
    if isinstance(command, str):
        command = shlex.split(command)
    if entrypoint is None:
        return ["pdserve", *command]
    if entrypoint in (["/bin/sh", "-c"], ["sh", "-c"]):
        assert len(command) == 1, f"sh -c takes one script, got {command}"
        words = shlex.split(command[0])
        return words[words.index("exec") + 1:] if "exec" in words else words
    return [*entrypoint, *command]


def _exports(service: dict) -> dict[str, str]:
    """NAME -> VALUE of each `export NAME=VALUE &&` a `sh -c` script runs before its `exec`; nothing else may
    come before the exec."""
    if service.get("entrypoint") not in (["/bin/sh", "-c"], ["sh", "-c"]):
        return {}
    words = shlex.split(service["command"][0])
    before = words[:words.index("exec")] if "exec" in words else []
    exports = {}
    while before:
        assert before[0] == "export" and before[2] == "&&" and "=" in before[1], f"unexpected script: {before}"
        name, value = before[1].split("=", 1)
        exports[name] = value
        before = before[3:]
    return exports


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` in argv, None when absent; a flag given twice is an error."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    values += [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(values) <= 1, f"{name} given {len(values)} times in {argv}"
    return values[0] if values else None


def _published(port) -> tuple[str, int]:
    """(host port, container port) of one `ports` entry, short ("[IP:]HOST:CONTAINER[/proto]") or long syntax."""
    if isinstance(port, dict):
        return str(port.get("published", "")), int(port["target"])
    *host, container = str(port).split("/")[0].split(":")
    return (host[-1] if host else ""), int(container)


def _mounts(service: dict) -> dict[str, dict]:
    """target path -> {source, read_only} for each volume of a service, short or long syntax."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = {"source": volume.get("source"), "read_only": bool(volume.get("read_only"))}
        else:
            source, target, *mode = volume.split(":")
            mounts[target] = {"source": source, "read_only": "ro" in (mode[0].split(",") if mode else [])}
    return mounts


def _gpu_devices(service: dict) -> list:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in (raw.strip() for raw in joined.splitlines()) if ln]


def _dockerfile_uid() -> str:
    """The uid of the user the image runs as (useradd --uid)."""
    runs = " ".join(rest for instr, rest in _dockerfile() if instr == "RUN")
    return re.search(r"useradd [^&]*--uid (\d+)", runs)[1]


def _dockerfile_pki_dirs() -> set[str]:
    """Folders the image creates, owns by its user and makes 0700 under /pki."""
    runs = " ".join(rest for instr, rest in _dockerfile() if instr == "RUN")
    made = set(re.findall(r"/pki/\w+", re.search(r"mkdir -p ([^&]*)", runs)[1]))
    owned = set(re.findall(r"/pki/\w+", re.search(r"chown pdserve:pdserve ([^&]*)", runs)[1]))
    private = set(re.findall(r"/pki/\w+", re.search(r"chmod 0700 ([^&]*)", runs)[1]))
    return made & owned & private


def _dockerfile_args() -> dict[str, str | None]:
    args = {}
    for instruction, rest in _dockerfile():
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"') if _ else None
    return args


# ---------------------------------------------------------------------------------------------------------------
# Validity

def test_vendored_schema_is_the_compose_specification():
    schema = _schema()
    # Its "$schema" spells draft-07 in a form jsonschema does not look up, so the validator is chosen here.
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["title"] == "Compose Specification"
    assert {"services", "volumes", "networks"} <= set(schema["properties"])


def test_file_matches_the_compose_specification_as_written_and_with_defaults():
    assert _schema_errors(_raw()) == []
    assert _schema_errors(_compose()) == []
    assert _schema_errors(_compose(PREFILL_REPLICAS="4", DECODE_REPLICAS="2", GATEWAY_PORT="6000")) == []


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d["services"]["gateway"]["depends_on"]["redis"].update(condition="service_ready"),
     "services/gateway/depends_on"),
    (lambda d: d["services"]["prefill"].update(replica=2), "services/prefill"),
    (lambda d: d["services"]["decode-gpu"]["deploy"]["resources"]["reservations"]["devices"][0].update(gpus=1),
     "services/decode-gpu/deploy/resources/reservations/devices/0"),
])
def test_schema_rejects_what_compose_rejects(mutate, where):
    document = _compose()
    mutate(document)
    errors = _schema_errors(document)
    assert errors, "the vendored schema accepted an invalid file"
    assert any(e.startswith(where) for e in errors), errors


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def _run_compose_cli(cli: list[str], *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # The file's own settings and COMPOSE_* variables of the caller's shell would change what is checked.
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE_FILE.read_text()))
    clean = {k: v for k, v in os.environ.items() if k not in used and not k.startswith("COMPOSE_")}
    return subprocess.run([*cli, "-f", str(COMPOSE_FILE), "--profile", "gpu", *args], cwd=ROOT,
                          env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120)


def test_compose_cli_accepts_the_file():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Compose CLI (docker-compose or the docker compose plugin) installed; "
                    "the schema test above still validates the file")
    quiet = _run_compose_cli(cli, "config", "-q")
    assert quiet.returncode == 0, f"{' '.join(cli)} config -q rejected docker-compose.yml:\n{quiet.stderr}"
    # The CLI's own interpolation agrees with the one these tests read the file with.
    resolved = _run_compose_cli(cli, "config", env={"PREFILL_REPLICAS": "3", "GATEWAY_PORT": "6000"})
    assert resolved.returncode == 0, resolved.stderr
    services = yaml.safe_load(resolved.stdout)["services"]
    assert int(services["prefill"]["deploy"]["replicas"]) == 3
    assert int(services["decode"]["deploy"]["replicas"]) == 1
    assert set(services) >= PDSERVE_SERVICES | {"redis"}


# ---------------------------------------------------------------------------------------------------------------
# The deployment contract

def test_services_exist():
    assert set(_compose()["services"]) >= PDSERVE_SERVICES | {"redis"}


def test_redis_is_the_official_image_with_a_password_from_its_config_file():
    redis = _compose()["services"]["redis"]
    assert redis["image"].split(":")[0] == "redis" and redis["image"].split(":")[1].startswith("7")
    # The password is in the config file pki wrote (redis.conf: requirepass), never on the command line.
    assert redis["command"][:2] == ["redis-server", "/pki/redis/redis.conf"]
    assert not any("pass" in arg for arg in redis["command"])
    assert _mounts(redis) == {"/pki/redis": {"source": "pki-redis", "read_only": True}}
    assert redis["depends_on"]["pki"]["condition"] == "service_completed_successfully"
    # The healthcheck authenticates (REDISCLI_AUTH keeps the password out of redis-cli's argv) and needs PONG:
    # an unauthenticated ping answers NOAUTH.
    kind, script = redis["healthcheck"]["test"]
    assert kind == "CMD-SHELL"
    assert script == 'REDISCLI_AUTH="$(cat /pki/redis/password)" redis-cli ping | grep -q PONG'
    # It reads its files as the uid that owns the volume (the image's pdserve user).
    assert redis["user"].split(":")[0] == _dockerfile_uid()


def test_gateway_publishes_50051():
    assert ("50051", 50051) in [_published(p) for p in _compose()["services"]["gateway"]["ports"]]
    moved = _compose(GATEWAY_PORT="6000")["services"]["gateway"]["ports"]
    assert ("6000", 50051) in [_published(p) for p in moved]


def test_gateway_publishes_its_openai_http_api_on_8000():
    gateway = _compose()["services"]["gateway"]
    assert _flag(_argv(gateway), "--http-port") == "8000"
    assert ("8000", 8000) in [_published(p) for p in gateway["ports"]]
    moved = _compose(GATEWAY_HTTP_PORT="9000")["services"]["gateway"]["ports"]
    assert ("9000", 8000) in [_published(p) for p in moved]


def test_only_the_gateway_publishes_ports():
    published = {name for name, svc in _compose()["services"].items() if svc.get("ports")}
    assert published == {"gateway"}


def test_every_pdserve_service_runs_the_pdserve_image():
    for name, service in _compose()["services"].items():
        is_pdserve = name in PDSERVE_SERVICES
        assert service.get("image", "").startswith("pdserve:") == is_pdserve, name
        assert ("build" in service) == is_pdserve, name
        if is_pdserve:
            assert _argv(service)[0] == "pdserve", name


def test_serving_services_are_health_checked_with_pdserve_health_on_their_health_port():
    services = _compose()["services"]
    for name in SERVING_SERVICES:
        test = services[name]["healthcheck"]["test"]
        argv = _argv(services[name])
        # The main ports need TLS (and, on workers, a cluster certificate): the plaintext health-only port answers.
        assert test == ["CMD", "pdserve", "health", test[3]], (name, test)
        host, port = test[3].rsplit(":", 1)
        assert host in ("127.0.0.1", "localhost"), (name, test)
        assert port == _flag(argv, "--health-port") != _flag(argv, "--port"), (name, test)
        assert _flag(argv, "--host") == "0.0.0.0", name


def test_model_fetch_is_a_one_shot_fetch_into_the_models_volume():
    fetch = _compose()["services"]["model-fetch"]
    assert _argv(fetch) == ["pdserve", "fetch-model"]
    assert fetch.get("restart", "no") == "no"
    assert "deploy" not in fetch and "healthcheck" not in fetch


def test_serving_services_wait_for_redis_healthy_and_the_model_fetched():
    services = _compose()["services"]
    for name in SERVING_SERVICES:
        depends_on = services[name]["depends_on"]
        assert depends_on["redis"]["condition"] == "service_healthy", name
        assert depends_on["model-fetch"]["condition"] == "service_completed_successfully", name
        assert depends_on["pki"]["condition"] == "service_completed_successfully", name


def test_gpu_reservations_only_on_gpu_profile_workers():
    services = _compose()["services"]
    for name, service in services.items():
        argv = _argv(service)
        if name in GPU_WORKER_SERVICES:
            assert service["profiles"] == ["gpu"], name
            assert _gpu_devices(service) == GPU_RESERVATION, name
            assert _flag(argv, "--device") == "cuda", name
            assert service["build"]["args"]["TORCH_INDEX"] != CPU_TORCH_INDEX, name
            assert "gpu" in service["build"]["args"]["PDSERVE_EXTRAS"].split(","), name
        else:
            # Everything else runs by default (no profile) and on the CPU.
            assert "profiles" not in service, name
            assert _gpu_devices(service) == [], name
            assert _flag(argv, "--device") in (None, "cpu"), name
    # One image per build configuration: services sharing an image tag build it identically.
    builds: dict[str, dict] = {}
    for name in PDSERVE_SERVICES:
        assert builds.setdefault(services[name]["image"], services[name]["build"]) == services[name]["build"], name
    assert len(builds) == 2


def test_models_volume_is_mounted_on_every_pdserve_service():
    config = _compose()
    home = next(rest.split("=", 1)[1] for instr, rest in _dockerfile()
                if instr == "ENV" and rest.startswith("PDSERVE_HOME="))
    assert "models" in config["volumes"]
    assert "models" not in {m["source"] for m in _mounts(config["services"]["pki"]).values()}
    for name in PDSERVE_SERVICES - {"pki"}:
        mount = _mounts(config["services"][name]).get(home)
        assert mount is not None and mount["source"] == "models", f"{name} does not mount models at {home}"
        # Only the fetcher writes the model; the servers read it.
        assert mount["read_only"] == (name != "model-fetch"), name


def _pki_dir(name: str) -> str:
    return "/pki/" + ("gateway" if name == "gateway" else name.split("-")[0])


def test_pdserve_services_get_the_redis_url_from_their_own_volume_in_the_environment():
    services = _compose()["services"]
    for name in SERVING_SERVICES:
        argv = _argv(services[name])
        assert _flag(argv, "--redis-url") is None, name  # it carries the password: never in argv
        assert _exports(services[name]) == {"PDSERVE_REDIS_URL": f"$(cat {_pki_dir(name)}/redis-url)"}, name
        assert _flag(argv, "--model") == "default", name


def test_pki_writes_every_services_secrets_into_its_own_volume_once():
    pki = _compose()["services"]["pki"]
    assert _argv(pki)[:4] == ["pdserve", "certs", "--compose", "/pki"]
    assert pki.get("restart", "no") == "no" and pki["network_mode"] == "none"
    assert _mounts(pki) == {f"/pki/{role}": {"source": f"pki-{role}", "read_only": False}
                            for role in ("gateway", "prefill", "decode", "redis")}
    # `pdserve certs --compose` lays the folders out as the services mount them.
    assert {f"/pki/{role}" for role in ("gateway", "prefill", "decode", "redis")} <= _dockerfile_pki_dirs()


def test_every_server_mounts_only_its_own_keys_read_only():
    services = _compose()["services"]
    for name in SERVING_SERVICES:
        pki_mounts = {target: m for target, m in _mounts(services[name]).items() if target.startswith("/pki")}
        own = _pki_dir(name)
        assert pki_mounts == {own: {"source": "pki-" + own.rsplit("/", 1)[1], "read_only": True}}, name


def test_every_server_runs_mutual_tls_with_its_roles_certificate():
    services = _compose()["services"]
    for name in SERVING_SERVICES:
        argv = _argv(services[name])
        own = _pki_dir(name)
        assert (_flag(argv, "--cluster-ca"), _flag(argv, "--cluster-cert"), _flag(argv, "--cluster-key")) == (
            f"{own}/ca.pem", f"{own}/tls.pem", f"{own}/tls-key.pem"), name
        assert "--insecure-internal" not in argv, name


def test_the_gateway_serves_clients_over_tls_with_api_keys():
    argv = _argv(_compose()["services"]["gateway"])
    assert _flag(argv, "--api-key-file") == "/pki/gateway/api-keys"
    assert (_flag(argv, "--tls-cert"), _flag(argv, "--tls-key")) == ("/pki/gateway/public.pem",
                                                                     "/pki/gateway/public-key.pem")
    assert "--allow-unauthenticated" not in argv


def test_workers_and_redis_are_only_on_the_internal_network():
    config = _compose()
    assert config["networks"]["internal"]["internal"] is True
    assert config["networks"]["edge"].get("internal", False) is False
    services = config["services"]
    for name in WORKER_SERVICES | {"redis"}:
        assert services[name]["networks"] == ["internal"], name
        assert "ports" not in services[name], name
    assert sorted(services["gateway"]["networks"]) == ["edge", "internal"]
    assert services["model-fetch"]["networks"] == ["edge"]  # it downloads; it reaches nothing internal


def test_workers_are_named_and_reached_by_their_container_hostname():
    services = _compose()["services"]
    for name in WORKER_SERVICES:
        service = services[name]
        argv = _argv(service)
        role = "prefill-worker" if name.startswith("prefill") else "decode-worker"
        assert argv[:2] == ["pdserve", role], name
        # `$${HOSTNAME}` in the file reaches the shell as ${HOSTNAME}: unique per replica, resolvable by the gateway.
        assert service["entrypoint"] in (["/bin/sh", "-c"], ["sh", "-c"]), name
        assert _flag(argv, "--worker-id") == "${HOSTNAME}", name
        assert _flag(argv, "--advertise-host") == "${HOSTNAME}", name
        if role == "prefill-worker":
            assert _flag(argv, "--transport") == "grpc", name


def test_pool_sizes_and_threads_follow_the_environment():
    default = _compose()["services"]
    assert default["prefill"]["deploy"]["replicas"] == "1"
    assert default["decode"]["deploy"]["replicas"] == "1"
    scaled = _compose(PREFILL_REPLICAS="2", DECODE_REPLICAS="3", PREFILL_THREADS="8", DECODE_THREADS="4")["services"]
    assert scaled["prefill"]["deploy"]["replicas"] == "2"
    assert scaled["decode"]["deploy"]["replicas"] == "3"
    assert _flag(_argv(scaled["prefill"]), "--threads") == "8"
    assert _flag(_argv(scaled["decode"]), "--threads") == "4"
    for name in WORKER_SERVICES:
        assert int(_flag(_argv(default[name]), "--threads")) >= 1, name
        assert int(_flag(_argv(default[name]), "--kv-cache-memory")) > 0, name


# ---------------------------------------------------------------------------------------------------------------
# The image

def test_dockerfile_entrypoint_is_pdserve():
    entrypoints = [rest for instr, rest in _dockerfile() if instr == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["pdserve"]


def test_dockerfile_runs_unprivileged_on_python_slim_with_cpu_torch_by_default():
    instructions = _dockerfile()
    assert [rest for instr, rest in instructions if instr == "FROM"] == ["python:3.11-slim"]
    users = [rest for instr, rest in instructions if instr == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    args = _dockerfile_args()
    assert args["TORCH_SPEC"] == "torch==2.13.0"
    assert args["TORCH_INDEX"] == CPU_TORCH_INDEX


def test_compose_build_args_are_declared_in_the_dockerfile():
    declared = set(_dockerfile_args())
    for name in PDSERVE_SERVICES:
        args = set(_compose()["services"][name]["build"].get("args", {}))
        assert args <= declared, f"{name} passes build args the Dockerfile does not declare: {args - declared}"
