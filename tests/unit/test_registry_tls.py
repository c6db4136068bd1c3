"""The registry on Redis over TLS, refused where TLS is wrong: a certificate the trusted CA did not sign, one that does
not name the host, a plain URL for a TLS-only port and the reverse, TLS options without TLS. Each refusal names TLS
and what to fix (RegistryTlsError; UNAVAILABLE at the API, no traceback), on a single redis-server and on a Redis
Cluster. The contract itself over TLS (create, get, list, delete, quotas, tombstones on both) is
tests/unit/test_registry.py's, run on the `redis-tls` and `cluster-tls` servers of support.redis_tls_fixture;
`inferscale serve` over TLS is tests/service/test_service_safety.py's."""
from __future__ import annotations

import time
import uuid
from urllib.parse import quote

import grpc
import pytest
from support.auth_fixture import refused, rich_refusal
from support.grpc_thread import ServerThread
from support.tls_certs import CertificateAuthority

from bench.local_redis import local_redis_cluster, local_redis_server
from inferscale_server.api import pb2, pb2_grpc
from inferscale_server.auth import Authenticator
from inferscale_server.gateway import GatewayCore
from inferscale_server.registry import NewFact, RedisRegistry, RegistryTlsError, open_registry


def _with_ca(url: str, ca_path) -> str:
    """The URL trusting another CA (its ssl_ca_certs= replaced)."""
    return f"{url.split('?', 1)[0]}?ssl_ca_certs={quote(str(ca_path))}"


def _refusal(url: str) -> RegistryTlsError:
    with pytest.raises(RegistryTlsError) as e:
        RedisRegistry(url, prefix=f"tls{uuid.uuid4().hex[:8]}:").ping()
    return e.value


@pytest.fixture(scope="module")
def stranger_ca(tmp_path_factory) -> CertificateAuthority:
    """A CA that signed none of the test servers' certificates."""
    return CertificateAuthority(tmp_path_factory.mktemp("stranger"), "stranger")


@pytest.fixture(params=["redis", "cluster"])
def tls_url(request):
    """A single redis-server's URL, then a Redis Cluster node's, both TLS only (support.redis_tls_fixture)."""
    return request.getfixturevalue("redis_tls_url" if request.param == "redis" else "redis_tls_cluster_url")


def test_the_ca_in_the_url_is_what_the_registry_trusts(tls_url, stranger_ca):
    """The URL's ssl_ca_certs= names the CA: the servers' own CA works; another CA, or none (the system's CAs),
    is refused at the first call, naming the node, the certificate check and the option to fix."""
    reg = RedisRegistry(tls_url, prefix=f"tls{uuid.uuid4().hex[:8]}:")
    (rec,) = reg.create("u", [NewFact("over TLS")])
    assert reg.get("u", rec.fact_id).text == "over TLS"
    reg.close()
    node = tls_url.split("//", 1)[1].split("/", 1)[0]
    for url in (_with_ca(tls_url, stranger_ca.cert), tls_url.split("?", 1)[0]):
        err = _refusal(url)
        assert str(err).startswith(f"TLS with the registry's Redis at {node} failed: "), err
        assert "self-signed certificate in certificate chain" in str(err) and "ssl_ca_certs=" in str(err)


def test_a_certificate_signed_by_another_ca_is_refused(redis_tls, stranger_ca):
    """The other way round: a server whose certificate a stranger CA signed, the URL trusting the registry's CA."""
    with local_redis_server(tls=stranger_ca.server_files("impostor")) as impostor:
        err = _refusal(_with_ca(impostor, redis_tls.ca))
    assert "TLS with the registry's Redis at 127.0.0.1:" in str(err) and "certificate" in str(err)


def test_a_certificate_for_another_name_is_refused_unless_only_the_ca_is_checked(redis_tls_ca):
    """The certificate must name the host connected to; ssl_check_hostname=false checks the CA alone."""
    with local_redis_server(tls=redis_tls_ca.server_files("elsewhere", hosts=("redis.example",))) as url:
        err = _refusal(url)
        assert "IP address mismatch, certificate is not valid for '127.0.0.1'" in str(err)
        reg = RedisRegistry(f"{url}&ssl_check_hostname=false", prefix="tls:")
        reg.create("u", [NewFact("the CA checked, not the name")])
        assert reg.count("u") == 1
        reg.close()


def test_a_server_that_asks_for_a_client_certificate_gets_the_urls(redis_tls_ca):
    """tls-auth-clients yes: a registry without a client certificate is refused (naming TLS); with the URL's
    ssl_certfile= and ssl_keyfile= (one the CA signed) it works."""
    import dataclasses

    server = dataclasses.replace(redis_tls_ca.server_files("strict"), clients_need_certificates=True)
    client = redis_tls_ca.server_files("registry-client")
    with local_redis_server(tls=server) as url:
        err = _refusal(url)
        assert "TLS with the registry's Redis at 127.0.0.1:" in str(err) and "ssl_certfile=" in str(err)
        reg = RedisRegistry(f"{url}&ssl_certfile={quote(client.cert)}&ssl_keyfile={quote(client.key)}", prefix="tls:")
        reg.create("u", [NewFact("with a client certificate")])
        assert reg.count("u") == 1
        reg.close()


def test_a_clusters_nodes_are_checked_at_the_addresses_they_announce(redis_tls_ca):
    """The URL names a host the certificates hold (localhost), but the client talks to the addresses the nodes
    announce (127.0.0.1), which they do not: refused, saying so; with ssl_check_hostname=false it works."""
    with local_redis_cluster(tls=redis_tls_ca.server_files("by-name", hosts=("localhost",))) as url:
        by_name = url.replace("127.0.0.1", "localhost")
        with pytest.raises(RegistryTlsError) as e:
            RedisRegistry(by_name, prefix="tls:").ping()
        assert "TLS with a node of the registry's Redis Cluster failed" in str(e.value)
        assert "addresses the nodes announce" in str(e.value) and "'127.0.0.1'" in str(e.value)
        reg = RedisRegistry(f"{by_name}&ssl_check_hostname=false", prefix="tls:")
        reg.create("u", [NewFact("on the cluster")])
        assert reg.count("u") == 1 and reg.cluster is True
        reg.close()


def test_plain_and_tls_urls_for_the_wrong_port_say_which_to_use(tls_url, redis_url):
    """redis:// for a TLS-only port, and rediss:// for a plain one: refused, naming the scheme to use (a plain
    client's only symptom is a reset connection, a TLS client's a timeout)."""
    plain_for_tls = "redis://" + tls_url.split("://", 1)[1].split("?", 1)[0]
    assert "speaks TLS only: the registry URL must be rediss://" in str(_refusal(plain_for_tls))
    t = time.monotonic()
    err = _refusal(f"rediss://{redis_url.split('://', 1)[1]}?{tls_url.split('?', 1)[1]}")
    assert "answers plain Redis, not TLS: use a redis:// URL" in str(err) and time.monotonic() - t < 15


def test_tls_options_without_tls_and_unreadable_files_are_named(tls_url, redis_url, tmp_path):
    with pytest.raises(ValueError, match=r"ssl_ca_certs= is for TLS: the URL must be rediss://, got redis://"):
        open_registry(f"{redis_url}?ssl_ca_certs={tmp_path}/ca.crt")
    missing = tmp_path / "no-such-ca.crt"
    err = _refusal(_with_ca(tls_url, missing))
    assert str(err) == f"registry URL option ssl_ca_certs={missing}: cannot read it (No such file or directory)"


def test_a_tls_failure_is_unavailable_naming_tls_at_the_api_and_in_health(redis_tls_url, stranger_ca):
    """Through the gateway's gRPC server: an add answers UNAVAILABLE naming TLS with a retry hint, no traceback;
    Health says which error (the server log has the whole message)."""
    reg = RedisRegistry(_with_ca(redis_tls_url, stranger_ca.cert), prefix="tls:")
    srv = ServerThread(GatewayCore(reg, auth=Authenticator.insecure()))
    try:
        with srv.channel() as ch:
            stub = pb2_grpc.MemoryStub(ch)

            def add():
                stub.AddFacts(pb2.AddFactsRequest(user_id="u", facts=[pb2.FactInput(text="never stored")]))

            code, message = refused(add)
            _, details, _ = rich_refusal(add)
            health = stub.Health(pb2.HealthRequest())
        assert code == grpc.StatusCode.UNAVAILABLE and details["RetryInfo"].retry_delay.ToMilliseconds() > 0
        assert "TLS with it failed" in message and "Traceback" not in message and ".py" not in message
        assert details["ErrorInfo"].reason == "UNAVAILABLE"  # no reason of its own: REGISTRY_UNAVAILABLE has none
        assert health.status == "DEGRADED" and health.components["registry"] == "error: RegistryTlsError"
    finally:
        srv.stop()
        reg.close()
