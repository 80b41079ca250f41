"""TLS on every connection (``transport.TlsConfig``, a deployment file's ``"tls"`` section), on real
servers and processes on 127.0.0.1 with certificates this file makes (``cryptography``): a CA, a
server certificate for ``localhost``/``127.0.0.1``, a client certificate, and a second CA no one
trusts.

- A cluster (a directory and nodes as processes) under TLS: the nodes register with the directory
  and an engine puts and reads blocks, all over TLS 1.3; the metrics endpoint serves HTTPS.
- Refused, each with a typed error saying why: a plaintext client (the server closes it; its
  handshake deadline closes one that sends nothing), a client that trusts another CA, a TLS client
  of a plaintext server, and -- under mutual TLS -- a client without a certificate.
- Beyond loopback: a server asked to listen on 0.0.0.0 without TLS refuses to start (in process:
  ``TlsRequired``; ``kvcc serve``: exit 2, no state written); with ``"tls": {"mode": "off"}`` it
  starts. Loopback without a ``tls`` section is plaintext as before.
- Bad settings (a missing file, a key that is not the certificate's, unknown keys) fail before any
  state changes.
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvcc.reference import serve
from kvcc.reference.cluster import ENGINE_TENANT, LocalCluster
from kvcc.reference.errors import ConnectionFailed
from kvcc.reference.loop import loop_factory
from kvcc.reference.transport import Client, Server, ServerLimits, TlsConfig, TlsConfigError, TlsRequired
from kvcc.reference.wire import Ping, Pong, Session
from kvcc.spec.keys import Namespace, chain_keys

for _name, _value in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                      "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
    os.environ.setdefault(_name, _value)

NS = Namespace("tls", "r1", "bfloat16", 4)
TENANT, TOKEN = "engine", bytes(range(32))
HANDSHAKE_TIMEOUT_MS = 1_000
WAIT_S = 15.0  # far above every deadline here: how long a test waits for a close or a start


# ------------------------------------------------------------------------------------ certificates


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer: tuple | None, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_key, issuer_cert = issuer if issuer is not None else (key, None)
    b = (x509.CertificateBuilder().subject_name(_name(subject))
         .issuer_name(issuer_cert.subject if issuer_cert is not None else _name(subject))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True)  # fmt: skip
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)  # fmt: skip
        b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(d: Path, name: str, key, cert: x509.Certificate) -> None:
    (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))  # fmt: skip
    (d / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """``ca``, ``server`` (signed by ca), ``client`` (signed by ca), ``other-ca``, ``other-server``
    (signed by other-ca): each a ``.crt`` and a ``.key``."""
    d = tmp_path_factory.mktemp("pki")
    for ca_name, leaves in (("ca", ("server", "client")), ("other-ca", ("other-server",))):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _issue(f"kvcc test {ca_name}", ca_key, None, ca=True)
        _write(d, ca_name, ca_key, ca_cert)
        for leaf in leaves:
            key = ec.generate_private_key(ec.SECP256R1())
            _write(d, leaf, key, _issue(f"kvcc test {leaf}", key, (ca_key, ca_cert), ca=False))
    return d


def tls_section(pki: Path, **more) -> dict:
    return {"cert": str(pki / "server.crt"), "key": str(pki / "server.key"), "ca": str(pki / "ca.crt"), **more}


# ------------------------------------------------------------------------------------ helpers


def run(coro):
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)


async def _echo(tenant, msg):
    return msg


async def _ping(port: int, tls: TlsConfig | None, **kw) -> Client:
    """A Ping round trip; returns the client (closed) for its stats."""
    async with Client("127.0.0.1", port, TENANT, TOKEN, tls=tls, connect_timeout_ms=5_000, timeout_ms=5_000, **kw) as c:
        await c.ping()
        return c


def _closed_within(port: int, send: bytes, limit_s: float) -> float:
    """Connect with a raw socket, send ``send``, return how long until the server closed it."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        s.settimeout(WAIT_S)
        if send:
            s.sendall(send)
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
    took = time.monotonic() - start
    assert took < limit_s, f"the server kept the connection {took:.1f} s"
    return took


def _port(cluster: LocalCluster, name: str) -> int:
    return int(cluster.procs[name].info["port"])


def _put_and_get(cluster: LocalCluster, client_id: str, seed: int) -> None:
    c = cluster.client(client_id)
    keys = list(chain_keys(NS, [seed, seed + 1]))
    data = [os.urandom(4096), os.urandom(5000)]
    parent = None
    for key, block in zip(keys, data):
        assert not hasattr(c.put(NS, key, parent, block), "reason")
        parent = key
    for key, block in zip(keys, data):
        lease = c.acquire(NS, key)
        assert not hasattr(lease, "reason"), lease
        assert c.read(lease) == block
        c.release(lease)


# ------------------------------------------------------------------------------------ a TLS cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pki):
    with LocalCluster(tmp_path_factory.mktemp("tls"), nodes=2, tiers=["dram=8MiB"], block_bytes=64 << 10,
                      namespaces=[NS], tls=tls_section(pki), metrics=True,
                      transport={"handshake_timeout_ms": HANDSHAKE_TIMEOUT_MS}) as c:  # fmt: skip
        yield c


def test_a_cluster_under_tls_serves_puts_and_reads(cluster):
    # The nodes registered with the directory (over TLS: it speaks nothing else), an engine writes
    # a chain on n1 and reads it back from the node, every hop under TLS.
    _put_and_get(cluster, "n1.engine", 1)
    _put_and_get(cluster, "n2.engine", 11)
    assert cluster.client("reader").refresh_nodes().keys() == {"n1", "n2"}

    async def negotiated() -> str:
        async with Client("127.0.0.1", _port(cluster, "n1"), ENGINE_TENANT, cluster.engine_token, tls=cluster.tls) as c:
            await c.ping()
            return c._conn.writer.get_extra_info("ssl_object").version()

    assert run(negotiated()) == "TLSv1.3"


def test_the_metrics_endpoint_serves_https_under_tls(cluster, pki):
    url = cluster.metrics_url("directory")
    assert url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with urllib.request.urlopen(url, context=ctx, timeout=WAIT_S) as r:
        assert b"kvcc_directory_connections" in r.read()
    with pytest.raises((OSError, http.client.HTTPException)):  # plaintext HTTP to HTTPS: closed, or no HTTP answer
        urllib.request.urlopen(url.replace("https://", "http://"), timeout=WAIT_S).read()


def test_a_plaintext_client_is_refused(cluster):
    for name in ("directory", "n1"):
        with pytest.raises(ConnectionFailed) as e:
            run(_ping(_port(cluster, name), None))
        assert e.value.code in ("eof", "reset"), e.value
        assert "it is serving TLS and this client is not" in e.value.detail


def test_a_client_that_trusts_another_ca_is_refused(cluster, pki):
    wrong = TlsConfig(cert=str(pki / "other-server.crt"), key=str(pki / "other-server.key"), ca=str(pki / "other-ca.crt"))
    for name in ("directory", "n2"):
        with pytest.raises(ConnectionFailed) as e:
            run(_ping(_port(cluster, name), wrong))
        assert e.value.code == "tls"
        assert "not trusted" in e.value.detail and "tls ca" in e.value.detail
    # The name checked is the one dialled (an IP SAN here), or server_name: a wrong one is refused.
    misnamed = TlsConfig(cert=str(pki / "server.crt"), key=str(pki / "server.key"), ca=str(pki / "ca.crt"),
                         server_name="kvcc.example")  # fmt: skip
    with pytest.raises(ConnectionFailed) as e:
        run(_ping(_port(cluster, "directory"), misnamed))
    assert e.value.code == "tls" and "kvcc.example" in e.value.detail


def test_the_tls_handshake_spends_the_handshake_deadline(cluster):
    # A socket that never starts TLS, and one that speaks plaintext frames: both closed, the first
    # by the handshake deadline (1 s here), never held open.
    for name in ("directory", "n1"):
        took = _closed_within(_port(cluster, name), b"", HANDSHAKE_TIMEOUT_MS / 1000 + 5)
        assert took >= HANDSHAKE_TIMEOUT_MS / 1000 * 0.8
        _closed_within(_port(cluster, name), Session.client(TENANT, TOKEN).send(Ping(0)), 5)
    # The cluster still serves.
    _put_and_get(cluster, "n1.after", 21)


# ------------------------------------------------------------------------------------ mutual TLS


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, pki):
    section = tls_section(pki, require_client_cert=True, client_cert=str(pki / "client.crt"),
                          client_key=str(pki / "client.key"))  # fmt: skip
    with LocalCluster(tmp_path, nodes=1, tiers=["dram=8MiB"], block_bytes=64 << 10, namespaces=[NS], tls=section) as c:
        _put_and_get(c, "n1.engine", 31)  # nodes and engine present the client certificate
        no_cert = TlsConfig(cert=str(pki / "server.crt"), key=str(pki / "server.key"), ca=str(pki / "ca.crt"))
        for name in ("directory", "n1"):
            with pytest.raises(ConnectionFailed) as e:
                run(_ping(_port(c, name), no_cert))
            assert e.value.code in ("tls", "eof", "reset"), e.value
            assert "certificate" in e.value.detail
        # A certificate from a CA the servers do not trust is refused too.
        foreign = TlsConfig(cert=str(pki / "server.crt"), key=str(pki / "server.key"), ca=str(pki / "ca.crt"),
                            client_cert=str(pki / "other-server.crt"), client_key=str(pki / "other-server.key"))  # fmt: skip
        with pytest.raises(ConnectionFailed) as e:
            run(_ping(_port(c, "directory"), foreign))
        assert e.value.code in ("tls", "eof", "reset") and "certificate" in e.value.detail, e.value
        _put_and_get(c, "n1.after", 41)


# ------------------------------------------------------------------------------------ in process


def test_a_tls_client_of_a_plaintext_server_gets_a_tls_error(pki):
    tls = TlsConfig(**tls_section(pki))

    async def go() -> None:
        async with Server(_echo, {TENANT: TOKEN}) as server:  # loopback, no tls: plaintext as ever
            with pytest.raises(ConnectionFailed) as e:
                await _ping(server.port, tls)
            assert e.value.code == "tls"
            assert "did not answer in TLS" in e.value.detail
            await _ping(server.port, None)  # and it serves plaintext clients still

    run(go())


def test_loopback_needs_no_tls_and_beyond_it_tls_or_an_explicit_off(pki):
    async def go() -> None:
        for host in ("127.0.0.1", "localhost", "::1"):
            try:
                async with Server(_echo, {TENANT: TOKEN}, host=host):
                    pass
            except OSError:
                assert host == "::1"  # no IPv6 on this machine: nothing to show
        for host in ("0.0.0.0", "", "kvcc.example"):
            server = Server(_echo, {TENANT: TOKEN}, host=host)
            with pytest.raises(TlsRequired, match='"mode": "off"'):
                await server.start()
            assert server._server is None  # nothing listened
        async with Server(_echo, {TENANT: TOKEN}, host="0.0.0.0", tls=TlsConfig(mode="off")) as server:
            reply = await Client("127.0.0.1", server.port, TENANT, TOKEN).request(Ping(7))
            assert reply == Pong(7)
        async with Server(_echo, {TENANT: TOKEN}, host="0.0.0.0", tls=TlsConfig(**tls_section(pki))) as server:
            await _ping(server.port, TlsConfig(**tls_section(pki)))

    run(go())


def test_tls_handshakes_spend_the_handshake_deadline_and_the_unauthenticated_limit(pki):
    limits = ServerLimits(handshake_timeout_ms=500, max_unauthenticated=4)
    tls = TlsConfig(**tls_section(pki))

    async def go() -> None:
        async with Server(_echo, {TENANT: TOKEN}, tls=tls, limits=limits) as server:
            # A handshake begun and never finished is closed at the deadline.
            took = await asyncio.to_thread(_closed_within, server.port, b"\x16\x03\x01", 5)  # a ClientHello begun
            assert took >= 0.4
            assert server.stats["handshake_timeouts"] == 1
            # A plaintext frame is no ClientHello: closed at once, counted as a failed handshake.
            await asyncio.to_thread(_closed_within, server.port, Session.client(TENANT, TOKEN).send(Ping(0)), 0.4)
            assert server.stats["tls_handshake_failures"] == 1
            # Idle sockets beyond max_unauthenticated close the oldest handshakes: never a lockout.
            loop = asyncio.get_running_loop()
            idle = [await loop.run_in_executor(None, socket.create_connection, ("127.0.0.1", server.port)) for _ in range(10)]
            try:
                await _ping(server.port, tls)
                assert server.stats["evicted_unauthenticated"] >= 6
                assert len(server._handshaking) + len(server._unauthenticated) <= limits.max_unauthenticated
            finally:
                for s in idle:
                    s.close()

    run(go())


def test_tls_contexts_require_tls_1_2_and_verify_what_they_should(pki):
    tls = TlsConfig(**tls_section(pki))
    server, client = tls.server_context(), tls.client_context()
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert server.maximum_version == ssl.TLSVersion.MAXIMUM_SUPPORTED  # 1.3 where both can
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert server.verify_mode == ssl.CERT_NONE  # no client certificates asked for
    mutual = TlsConfig(**tls_section(pki), require_client_cert=True)
    assert mutual.server_context().verify_mode == ssl.CERT_REQUIRED
    assert tls.server_context() is server  # read once


def _config(tmp_path: Path, tls) -> Path:
    raw = {"lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "nodes",
           "tenants": {"nodes": {"token": os.urandom(32).hex(), "operator": True}}}  # fmt: skip
    if tls is not None:
        raw["tls"] = tls
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(raw))
    return path


def test_bad_tls_settings_fail_before_any_state_changes(tmp_path, pki):
    cases = {
        "missing cert": (tls_section(pki, cert=str(tmp_path / "nope.crt")), "nope.crt"),
        "key of another cert": (tls_section(pki, key=str(pki / "client.key")), "matching private key"),
        "ca not a certificate": (tls_section(pki, ca=str(pki / "server.key")), "tls ca"),
        "unknown setting": ({"mode": "on", "certfile": "x"}, "unknown tls settings"),
        "off and a cert": ({"mode": "off", "cert": "x"}, "either serve TLS or say off"),
        "no ca": ({"cert": "a", "key": "b"}, "['ca'] not given"),
        "bad mode": ({"mode": "maybe"}, "tls mode"),
    }
    for what, (section, says) in cases.items():
        state = tmp_path / what.replace(" ", "-")
        with pytest.raises(serve.TlsSettingError, match=re.escape(says)) as e:
            config = serve.ClusterConfig.load(_config(tmp_path, section))
            run(serve.serve_node(config, node_id="n1", directory="127.0.0.1:1", state=state, host="127.0.0.1",
                                 port=0, tiers=[("dram", 1 << 20)]))  # fmt: skip
        assert isinstance(e.value, serve.ConfigError) and isinstance(e.value, TlsConfigError), what
        assert not state.exists(), f"{what}: the node took an incarnation"
    # The directory likewise: no durable log opened.
    config = serve.ClusterConfig.load(_config(tmp_path, tls_section(pki, key=str(pki / "client.key"))))
    with pytest.raises(serve.TlsSettingError, match="matching private key"):
        run(serve.serve_directory(config, state=tmp_path / "dir-state", host="127.0.0.1", port=0))
    assert not (tmp_path / "dir-state").exists()
    # Relative paths are from the deployment file's directory.
    rel = {"cert": os.path.relpath(pki / "server.crt", tmp_path), "key": os.path.relpath(pki / "server.key", tmp_path),
           "ca": os.path.relpath(pki / "ca.crt", tmp_path)}  # fmt: skip
    serve.ClusterConfig.load(_config(tmp_path, rel)).check_serving("0.0.0.0")
    # A transport client reads its files when made, not at its first connection.
    with pytest.raises(TlsConfigError, match="nope.crt"):
        Client("127.0.0.1", 1, TENANT, TOKEN, tls=TlsConfig(**tls_section(pki, ca=str(tmp_path / "nope.crt"))))


# ------------------------------------------------------------------------------------ kvcc serve


def _serve(tmp_path: Path, config: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    ready, state = tmp_path / f"{name}.ready", tmp_path / f"{name}-state"
    argv = [sys.executable, "-m", "kvcc", "serve", "directory", "--config", str(config), "--state", str(state),
            "--ready-file", str(ready), *args]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, ready, state


def test_kvcc_serve_beyond_loopback_refuses_plaintext_unless_told_off(tmp_path):
    # No tls section, 0.0.0.0: exit 2, saying why, no durable log created.
    proc, ready, state = _serve(tmp_path, _config(tmp_path, None), "plain", "--host", "0.0.0.0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert "refusing to listen on '0.0.0.0' without TLS" in err
    assert not state.exists() and not ready.exists()
    # Explicitly off: it starts, and a plaintext client is served.
    off_dir = tmp_path / "off"
    off_dir.mkdir()
    proc, ready, state = _serve(off_dir, _config(off_dir, {"mode": "off"}), "off", "--host", "0.0.0.0")
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the directory did not start"
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S):
            pass
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
