"""`pdserve certs`: the cluster PKI and secrets for hand-run clusters, docker-compose and Kubernetes; and the
Redis URL that reaches the servers through PDSERVE_REDIS_URL instead of their command lines."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from decode_worker.config import DecodeWorkerConfig
from gateway.auth import parse_api_keys
from pdserve import cli, cli_args, pki
from protos.tls import Identity, identity_of_certificate, role_server_name

K8S_OVERLAY = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "overlays" / "cpu" / "kustomization.yaml"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def issued_by(child: Path, ca: Path) -> bool:
    try:
        cert(child).verify_directly_issued_by(cert(ca))
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def sans(path: Path) -> tuple[list[str], list[str]]:
    ext = cert(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ext.get_values_for_type(x509.DNSName), [str(ip) for ip in ext.get_values_for_type(x509.IPAddress)]


def test_k8s_writes_every_file_the_overlays_secret_generators_read(tmp_path):
    out = tmp_path / "secrets"
    assert cli.main(["certs", "--k8s", str(out)]) == 0
    read = {item.split("=", 1)[1].removeprefix("secrets/")
            for line in K8S_OVERLAY.read_text().splitlines() if "files:" in line
            for item in line.split("[", 1)[1].rstrip("]").replace(" ", "").split(",")}
    assert read == set(pki.K8S_FILES)
    assert read <= {p.name for p in out.iterdir()}
    assert mode(out) == 0o700
    for name in ("ca.key", "public.key", "gateway.key", "prefill.key", "decode.key", "redis-password", "redis-url",
                 "api-keys"):
        assert mode(out / name) == 0o600, name
    for role in ("gateway", "prefill", "decode"):
        assert identity_of_certificate((out / f"{role}.crt").read_bytes()) == Identity(role, "pool")
        assert role_server_name(role) in sans(out / f"{role}.crt")[0]
        assert issued_by(out / f"{role}.crt", out / "ca.crt")
    # The public certificate answers for the Service's names, and is not a cluster member.
    assert "pdserve-gateway.pdserve.svc" in sans(out / "public.crt")[0]
    assert issued_by(out / "public.crt", out / "public-ca.crt")
    assert not issued_by(out / "public.crt", out / "ca.crt")
    password = (out / "redis-password").read_text()
    assert len(password) >= 32
    assert (out / "redis-url").read_text() == f"redis://:{password}@pdserve-redis:6379/0"
    (key,) = parse_api_keys((out / "api-keys").read_text())
    assert key.tenant == "default"


def test_k8s_secrets_differ_on_every_run(tmp_path):
    for name in ("a", "b"):
        assert cli.main(["certs", "--k8s", str(tmp_path / name)]) == 0
    for name in ("redis-password", "api-keys", "ca.crt", "gateway.key"):
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "b" / name).read_bytes(), name


def test_out_writes_one_certificate_per_role_with_the_extra_hosts(tmp_path):
    assert cli.main(["certs", "--out", str(tmp_path), "--host", "node-1.lan", "--host", "10.0.0.7"]) == 0
    for role in ("gateway", "prefill", "decode", "probe"):
        assert identity_of_certificate((tmp_path / f"{role}.pem").read_bytes()) == Identity(role, role)
        assert mode(tmp_path / f"{role}-key.pem") == 0o600
        assert issued_by(tmp_path / f"{role}.pem", tmp_path / "ca.pem")
        dns, ips = sans(tmp_path / f"{role}.pem")
        assert "node-1.lan" in dns and "10.0.0.7" in ips and "127.0.0.1" in ips
    assert mode(tmp_path / "ca-key.pem") == 0o600
    assert "node-1.lan" in sans(tmp_path / "public.pem")[0]
    assert not issued_by(tmp_path / "public.pem", tmp_path / "ca.pem")


def test_out_names_processes_and_issues_more_under_an_existing_ca(tmp_path):
    first = tmp_path / "first"
    assert cli.main(["certs", "--out", str(first), "--name", "decode/decode-7", "--name", "gateway"]) == 0
    assert identity_of_certificate((first / "decode-7.pem").read_bytes()) == Identity("decode", "decode-7")
    assert not (first / "prefill.pem").exists()
    more = tmp_path / "more"
    assert cli.main(["certs", "--out", str(more), "--name", "prefill/prefill-2", "--ca-cert",
                     str(first / "ca.pem"), "--ca-key", str(first / "ca-key.pem")]) == 0
    assert (more / "ca.pem").read_bytes() == (first / "ca.pem").read_bytes()
    assert issued_by(more / "prefill-2.pem", first / "ca.pem")


@pytest.mark.parametrize("argv, message", [
    (["--name", "admin/x"], "role must be one of"),
    (["--name", "decode/public"], "public"),
    (["--ca-cert", "/nonexistent.pem"], "--ca-cert and --ca-key go together"),
])
def test_out_refuses_bad_identities_and_half_a_ca(tmp_path, argv, message, capsys):
    assert cli.main(["certs", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_compose_gives_each_service_only_its_own_secrets_and_keeps_them(tmp_path):
    assert cli.main(["certs", "--compose", str(tmp_path)]) == 0
    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert files == {
        *(f"{role}/{name}" for role in ("gateway", "prefill", "decode")
          for name in ("ca.pem", "tls.pem", "tls-key.pem", "redis-url")),
        "gateway/public.pem", "gateway/public-key.pem", "gateway/public-ca.pem", "gateway/api-keys",
        "redis/redis.conf", "redis/password"}
    for role in ("gateway", "prefill", "decode"):
        assert identity_of_certificate((tmp_path / role / "tls.pem").read_bytes()).role == role
        assert issued_by(tmp_path / role / "tls.pem", tmp_path / "gateway" / "ca.pem")
        assert mode(tmp_path / role / "tls-key.pem") == 0o600
    password = (tmp_path / "redis" / "password").read_text()
    assert (tmp_path / "redis" / "redis.conf").read_text() == f'requirepass "{password}"\n'
    assert (tmp_path / "decode" / "redis-url").read_text() == f"redis://:{password}@redis:6379/0"
    assert "gateway" in sans(tmp_path / "gateway" / "public.pem")[0]
    kept = (tmp_path / "gateway" / "tls-key.pem").read_bytes()
    assert cli.main(["certs", "--compose", str(tmp_path)]) == 0
    assert (tmp_path / "gateway" / "tls-key.pem").read_bytes() == kept
    assert cli.main(["certs", "--compose", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "gateway" / "tls-key.pem").read_bytes() != kept


def test_first_api_key_is_the_first_key_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ops\n\n" + "a" * 20 + " team-a max_concurrent=2\n" + "b" * 20 + "\n")
    assert pki.first_api_key(path) == "a" * 20


# ------------------------------------------------------------------------------------------------- Redis URL
def test_servers_take_the_redis_url_from_the_environment_when_no_flag_gives_one(monkeypatch):
    monkeypatch.setenv(cli_args.REDIS_URL_ENV, "redis://:pw@r:6379/0")
    args = cli_args.parse_args(["decode-worker", "--insecure-internal"])
    assert cli_args.worker_config(DecodeWorkerConfig, "decode", args).redis_url == "redis://:pw@r:6379/0"
    args = cli_args.parse_args(["gateway", "--insecure-internal"])
    assert cli_args.gateway_config(args).redis_url == "redis://:pw@r:6379/0"
    assert cli_args.cluster_config(cli_args.parse_args(["up"])).redis_url == "redis://:pw@r:6379/0"
    # A flag still wins.
    args = cli_args.parse_args(["gateway", "--insecure-internal", "--redis-url", "redis://other:1/0"])
    assert cli_args.gateway_config(args).redis_url == "redis://other:1/0"


def test_a_gateway_without_any_redis_url_exits_2_naming_both(monkeypatch, capsys):
    monkeypatch.delenv(cli_args.REDIS_URL_ENV, raising=False)
    assert cli.main(["gateway", "--insecure-internal"]) == 2
    err = capsys.readouterr().err
    assert "--redis-url" in err and "PDSERVE_REDIS_URL" in err
    monkeypatch.delenv(cli_args.REDIS_URL_ENV, raising=False)
    args = cli_args.parse_args(["decode-worker", "--insecure-internal"])
    assert cli_args.worker_config(DecodeWorkerConfig, "decode", args).redis_url is None  # unregistered


# ------------------------------------------------------------------------------------------------- health
@pytest.mark.parametrize("argv, message", [
    (["--cluster-ca", "/ca.pem"], "go together"),
    (["--server-role", "decode"], "--server-role needs"),
    (["--cluster-ca", "/c", "--cluster-cert", "/c", "--cluster-key", "/k", "--tls"], "excludes"),
])
def test_health_refuses_incomplete_tls_flags(argv, message, capsys):
    assert cli.main(["health", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_public_certificate_carries_loopback_for_local_clients(tmp_path):
    files = pki.write_public_tls(tmp_path, hosts=["gw.example"])
    dns, ips = sans(files.cert_path)
    assert {"localhost", "gw.example"} <= set(dns)
    assert ipaddress.ip_address("127.0.0.1") in map(ipaddress.ip_address, ips)


# ------------------------------------------------------------------------------------------------- clients
class RecordingClient:
    def __init__(self, target, timeout=None, **options):
        self.target, self.timeout, self.options = target, timeout, options


def test_generate_and_chat_build_their_client_with_the_key_and_tls_flags(monkeypatch):
    monkeypatch.setattr(cli, "Client", RecordingClient)
    monkeypatch.setenv(cli_args.API_KEY_ENV, "from-the-environment-0123")
    client = cli._client(cli_args.parse_args(["chat", "Hi", "--target", "gw:1", "--ca-cert", "/ca.pem"]))
    assert (client.target, client.options) == ("gw:1", {"api_key": "from-the-environment-0123", "tls": True,
                                                        "ca_cert": "/ca.pem"})
    client = cli._client(cli_args.parse_args(["generate", "x", "--api-key", "from-the-flag-0123456", "--tls"]))
    assert client.options == {"api_key": "from-the-flag-0123456", "tls": True, "ca_cert": None}
    monkeypatch.delenv(cli_args.API_KEY_ENV)
    assert cli._client(cli_args.parse_args(["chat"])).options == {"api_key": None, "tls": False, "ca_cert": None}
