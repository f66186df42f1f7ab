"""Cluster PKI and gRPC credentials: mutual TLS inside a cluster, server TLS on the gateway's public ports.

Identity. One cluster CA signs every process's certificate. A certificate names exactly one identity, as a
SPIFFE-style URI SAN ``spiffe://pdserve/<role>/<name>`` (``role`` one of ROLES: gateway, prefill, decode, probe;
``name`` the worker id or another process label). It also carries the DNS SANs ``<role>.pdserve.internal`` (the
role's server name, see below), ``localhost`` and any extra hosts, and the IP SANs 127.0.0.1, ::1 plus extra
IPs. Keys are ECDSA P-256.

Who checks what:

    server side   ssl_server_credentials(require_client_auth=True): no client certificate, or one of another
                  CA ─▶ the handshake fails. RoleInterceptor then reads the peer's role from the auth context
                  and allows the RPC only if the method's role table entry names that role (unknown methods
                  are denied): PERMISSION_DENIED otherwise.
    client side   the channel verifies the server against the cluster CA; with ``channel_options(role)`` it
                  also requires the server to be that role: the TLS host name checked is the role's server
                  name, which only certificates issued for that role carry (a gateway dialling a "decode
                  worker" endpoint taken from Redis reaches only a real decode worker).

On disk (``write_cluster_pki``): ``ca.pem`` (and ``ca-key.pem``, kept where certificates are issued),
``<name>.pem`` and ``<name>-key.pem`` per process; keys are written 0600, the directory is 0700. The same
ServerCredentials / ChannelCredentials objects serve grpc and grpc.aio (``add_secure_port``,
``grpc.aio.secure_channel``). Rotation: issue new files under the same CA (or a bundle of old and new CA during a
CA change) and restart, or serve with ``reloading_server_credentials``, which picks up changed files at the next
handshake.

No torch, no redis; grpc and cryptography only.
"""
from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import ssl
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("gateway", "prefill", "decode", "probe")
TRUST_DOMAIN = "pdserve"
SERVER_NAME_SUFFIX = ".pdserve.internal"
ANY_ROLE = frozenset(ROLES)
"""A role-table entry that admits every authenticated member of the cluster."""

DEFAULT_CA_DAYS = 3650
DEFAULT_CERT_DAYS = 365
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class CertificateError(ValueError):
    """A certificate or key that cannot be used as asked (bad role or name, unparsable, no identity)."""


# ----------------------------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class Identity:
    """Who a certificate speaks for: ``role`` (one of ROLES) and ``name`` (worker id or process label)."""
    role: str
    name: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise CertificateError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.name or len(self.name) > 64 or not set(self.name) <= _NAME_CHARS:
            raise CertificateError(f"name must be 1-64 characters of [A-Za-z0-9._-], got {self.name!r}")

    @property
    def uri(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.name}"

    @classmethod
    def from_uri(cls, uri: str) -> Identity:
        prefix = f"spiffe://{TRUST_DOMAIN}/"
        role, sep, name = uri[len(prefix):].partition("/") if uri.startswith(prefix) else ("", "", "")
        if not sep:
            raise CertificateError(f"not a pdserve identity: {uri!r}")
        return cls(role, name)


def role_server_name(role: str) -> str:
    """The DNS name every certificate of `role` carries, checked by clients as the server's host name."""
    if role not in ROLES:
        raise CertificateError(f"role must be one of {ROLES}, got {role!r}")
    return role + SERVER_NAME_SUFFIX


def identity_of_certificate(cert_pem: bytes) -> Identity:
    """The one pdserve identity in a certificate's URI SANs; CertificateError when it has none or several."""
    return _identity_of_pem(bytes(cert_pem))


@functools.lru_cache(maxsize=256)
def _identity_of_pem(cert_pem: bytes) -> Identity:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise CertificateError(f"certificate without usable subject alternative names: {exc}") from None
    ids = [Identity.from_uri(uri) for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)
           if uri.startswith(f"spiffe://{TRUST_DOMAIN}/")]
    if len(ids) != 1:
        raise CertificateError(f"a certificate must name exactly one pdserve identity, this one names {len(ids)}")
    return ids[0]


# ----------------------------------------------------------------------------------------------- issuing
@dataclass(frozen=True)
class IssuedCertificate:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key."""
    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)  # 5 min of clock skew


class ClusterCA:
    """The cluster's certificate authority: ``ClusterCA.generate()`` or ``ClusterCA.load(cert, key)``;
    ``issue(role, name)`` signs a process certificate."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self._cert = cert
        self._key = key

    @classmethod
    def generate(cls, common_name: str = "pdserve cluster CA", valid_days: int = DEFAULT_CA_DAYS) -> ClusterCA:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, TRUST_DOMAIN),
                          x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        not_before, not_after = _validity(valid_days)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert, key)

    @classmethod
    def load(cls, cert_path: str | os.PathLike, key_path: str | os.PathLike) -> ClusterCA:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise CertificateError(f"{key_path} is not the EC private key of {cert_path}")
        return cls(cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self._key)

    def issue(self, role: str, name: str, *, hosts: Iterable[str] = (), valid_days: int = DEFAULT_CERT_DAYS
              ) -> IssuedCertificate:
        """A certificate for Identity(role, name), usable as TLS server and client. `hosts`: extra DNS names or
        IP addresses the process is reached at (beyond localhost, 127.0.0.1 and ::1)."""
        identity = Identity(role, name)
        key = ec.generate_private_key(ec.SECP256R1())
        dns = [role_server_name(role), "localhost"]
        ips = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
        for host in hosts:
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                if host not in dns:
                    dns.append(host)
            else:
                if ip not in ips:
                    ips.append(ip)
        sans = [x509.UniformResourceIdentifier(identity.uri), *map(x509.DNSName, dns), *map(x509.IPAddress, ips)]
        not_before, not_after = _validity(valid_days)
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, TRUST_DOMAIN),
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                             x509.NameAttribute(NameOID.COMMON_NAME, f"{role}/{name}")])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(self._cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(not_before).not_valid_after(min(not_after, self._cert.not_valid_after_utc))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=True,
                                             key_cert_sign=False, crl_sign=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        return IssuedCertificate(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


# ----------------------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class TlsFiles:
    """One process's TLS material on disk: its certificate and key, and the CA bundle it trusts."""
    cert_path: Path
    key_path: Path
    ca_path: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca_pem, cert_pem, key_pem), read now."""
        return self.ca_path.read_bytes(), self.cert_path.read_bytes(), self.key_path.read_bytes()


def write_file(path: Path, data: bytes, mode: int) -> None:
    """`data` at `path`, created with `mode` (never briefly readable by others) and replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_cluster_pki(directory: str | os.PathLike, identities: Iterable[tuple[str, str]], *,
                      ca: ClusterCA | None = None, hosts: Iterable[str] = ()) -> dict[str, TlsFiles]:
    """Write ``ca.pem``, ``ca-key.pem`` and, per (role, name) in `identities`, ``<name>.pem`` +
    ``<name>-key.pem`` into `directory` (created 0700); a fresh CA unless `ca` is given. Returns name ─▶ files."""
    identities = [Identity(role, name) for role, name in identities]
    names = [identity.name for identity in identities]
    if len(set(names)) != len(names) or "ca" in names:
        raise CertificateError(f"process names must be unique and not 'ca': {names}")
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca = ca or ClusterCA.generate()
    hosts = list(hosts)
    ca_path = directory / "ca.pem"
    write_file(ca_path, ca.cert_pem, 0o644)
    write_file(directory / "ca-key.pem", ca.key_pem, 0o600)
    files = {}
    for identity in identities:
        issued = ca.issue(identity.role, identity.name, hosts=hosts)
        cert_path, key_path = directory / f"{identity.name}.pem", directory / f"{identity.name}-key.pem"
        write_file(cert_path, issued.cert_pem, 0o644)
        write_file(key_path, issued.key_pem, 0o600)
        files[identity.name] = TlsFiles(cert_path, key_path, ca_path)
    return files


# ----------------------------------------------------------------------------------------------- credentials
def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Mutual TLS for an internal server (grpc or grpc.aio): clients must present a certificate of the CA."""
    ca_pem, cert_pem, key_pem = files.read()
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem, require_client_auth=True)


def reloading_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Like server_credentials, but a handshake after any of the three files changed (mtime or size) uses the
    new contents: certificates rotate without a restart. Unreadable files keep the previous configuration."""
    def stamp() -> tuple:
        return tuple((st.st_mtime_ns, st.st_size) for st in map(os.stat, (files.ca_path, files.cert_path,
                                                                        files.key_path)))

    def config() -> grpc.ServerCertificateConfiguration:
        ca_pem, cert_pem, key_pem = files.read()
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=ca_pem)

    state = {"stamp": stamp()}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            now = stamp()
            if now == state["stamp"]:
                return None
            fresh = config()
        except OSError:
            return None
        state["stamp"] = now
        return fresh

    return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Mutual TLS for an internal client (grpc.secure_channel or grpc.aio.secure_channel)."""
    ca_pem, cert_pem, key_pem = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem)


def channel_options(server_role: str) -> list[tuple[str, str]]:
    """Channel options that make the handshake accept only a server certificate of `server_role`."""
    return [("grpc.ssl_target_name_override", role_server_name(server_role))]


def public_server_credentials(cert_path: str | os.PathLike, key_path: str | os.PathLike) -> grpc.ServerCredentials:
    """Server-only TLS for the gateway's public gRPC port (clients authenticate with API keys)."""
    return grpc.ssl_server_credentials([(Path(key_path).read_bytes(), Path(cert_path).read_bytes())])


def public_channel_credentials(ca_path: str | os.PathLike | None = None) -> grpc.ChannelCredentials:
    """A client's TLS to the gateway: the CA bundle at `ca_path`, else the system's roots."""
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_path).read_bytes() if ca_path else None)


def https_ssl_context(cert_path: str | os.PathLike, key_path: str | os.PathLike) -> ssl.SSLContext:
    """Server SSLContext for the gateway's HTTPS front (aiohttp ``web.TCPSite(..., ssl_context=...)``)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    return context


# ----------------------------------------------------------------------------------------------- authorization
RoleTable = Mapping[str, frozenset[str]]

_GATEWAY = frozenset({"gateway"})
_OBSERVERS = frozenset({"gateway", "probe"})


def cluster_role_table() -> dict[str, frozenset[str]]:
    """DESIGN §10: only gateways call Reserve (and Renew) / Prefill / Decode / Abort; only prefill workers call
    KvTransfer.Push; Stats, health and reflection are for gateways and probes. Anything else is denied."""
    table = {
        "/pdserve.v1.DecodeWorker/Reserve": _GATEWAY,
        "/pdserve.v1.DecodeWorker/Renew": _GATEWAY,
        "/pdserve.v1.DecodeWorker/Decode": _GATEWAY,
        "/pdserve.v1.DecodeWorker/Abort": _GATEWAY,
        "/pdserve.v1.DecodeWorker/Stats": _OBSERVERS,
        "/pdserve.v1.PrefillWorker/Prefill": _GATEWAY,
        "/pdserve.v1.PrefillWorker/Abort": _GATEWAY,
        "/pdserve.v1.PrefillWorker/Stats": _OBSERVERS,
        "/pdserve.v1.KvTransfer/Push": frozenset({"prefill"}),
        "/grpc.health.v1.Health/Check": _OBSERVERS,
        "/grpc.health.v1.Health/Watch": _OBSERVERS,
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _OBSERVERS,
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": _OBSERVERS,
    }
    return table


def peer_identity(auth_context: Mapping[str, list[bytes]]) -> Identity | None:
    """The authenticated peer's identity from a servicer context's ``auth_context()``: None for a plaintext
    peer or a certificate without exactly one pdserve identity."""
    pem = auth_context.get("x509_pem_cert")
    if not pem:
        return None
    try:
        return identity_of_certificate(pem[0])
    except CertificateError:
        return None


def authorize(method: str, identity: Identity | None, table: RoleTable) -> tuple[grpc.StatusCode, str] | None:
    """None when `identity` may call `method`, else the status and message to answer with."""
    if identity is None:
        return grpc.StatusCode.UNAUTHENTICATED, "a pdserve cluster certificate is required"
    allowed = table.get(method)
    if allowed is None or identity.role not in allowed:
        return grpc.StatusCode.PERMISSION_DENIED, f"role {identity.role!r} may not call {method}"
    return None


def _guard(behavior: Callable, method: str, table: RoleTable) -> Callable:
    def guarded(request_or_iterator, context):
        denied = authorize(method, peer_identity(context.auth_context()), table)
        if denied is not None:
            context.abort(*denied)
        return behavior(request_or_iterator, context)
    return guarded


class RoleInterceptor(grpc.ServerInterceptor):
    """Sync grpc.server interceptor enforcing `table` (method ─▶ allowed roles) on every RPC."""

    def __init__(self, table: RoleTable) -> None:
        self._table = dict(table)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            wrap, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
        elif handler.unary_stream:
            wrap, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
        elif handler.stream_unary:
            wrap, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
        else:
            wrap, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
        return wrap(_guard(behavior, method, self._table), request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
