"""services/k8s_secrets.py, the chart's secret-init Job (secrets.generateInCluster): creates each missing Secret with a
random value, never reads a value out nor changes an existing Secret, and fails with the reason.

No Kubernetes API server runs on the development machines (no kube-apiserver, no container runtime), so the module
talks here to a stand-in on 127.0.0.1 that answers the two calls it makes as the API server documents them
(GET .../secrets/NAME: 200 or 404; POST .../secrets: 201, or 409 AlreadyExists), checks the bearer token and keeps
what was created. NOT RUN here: the Job in a cluster (its RBAC, the service-account mount, the hook order); the chart's
rendering of it is tests/packaging/test_chart.py::test_secrets_made_in_the_cluster_render_the_same_every_time."""
from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from inferscale_server.k8s_secrets import ApiServer, ensure_secrets, main, parse_wanted

TOKEN, NAMESPACE = "sa-token-for-the-test", "inferscale"


class StandInApiServer:
    """The Secrets endpoints of a Kubernetes API server, for one namespace, over plain HTTP on loopback."""

    def __init__(self):
        self.secrets: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.conflict_on_create: set[str] = set()  # names a concurrent run creates between our GET and POST
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                outer.calls.append((self.command, self.path))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._answer(401, {"kind": "Status", "message": "Unauthorized", "code": 401})
                    return False
                return True

            def do_GET(self):
                if not self._authorized():
                    return
                prefix = f"/api/v1/namespaces/{NAMESPACE}/secrets/"
                name = self.path[len(prefix):] if self.path.startswith(prefix) else None
                if name in outer.secrets:
                    self._answer(200, outer.secrets[name])
                else:
                    self._answer(404, {"kind": "Status", "message": f'secrets "{name}" not found', "code": 404})

            def do_POST(self):
                if not self._authorized():
                    return
                if self.path != f"/api/v1/namespaces/{NAMESPACE}/secrets":
                    self._answer(404, {"kind": "Status", "message": "not found", "code": 404})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                name = body["metadata"]["name"]
                if name in outer.conflict_on_create:
                    outer.secrets[name] = {**body, "data": {k: base64.b64encode(b"theirs").decode()
                                                            for k in body["data"]}}
                if name in outer.secrets:
                    self._answer(409, {"kind": "Status", "reason": "AlreadyExists",
                                       "message": f'secrets "{name}" already exists', "code": 409})
                    return
                outer.secrets[name] = body
                self._answer(201, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def api(self, token: str = TOKEN) -> ApiServer:
        return ApiServer(f"http://127.0.0.1:{self.server.server_address[1]}", token, NAMESPACE, None)

    def value(self, name: str, key: str) -> str:
        return base64.b64decode(self.secrets[name]["data"][key]).decode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def apiserver():
    s = StandInApiServer()
    yield s
    s.close()


def test_missing_secrets_are_created_once_with_random_values_and_then_kept(apiserver, capsys):
    argv = ["rel-redis-auth/password", "rel-jwt/secret", "--label=app.kubernetes.io/instance=rel"]
    assert main(argv, api=apiserver.api()) == 0
    assert "Secret rel-redis-auth: created" in capsys.readouterr().out
    password, key = apiserver.value("rel-redis-auth", "password"), apiserver.value("rel-jwt", "secret")
    assert len(password) >= 32 and len(key) >= 32 and password != key
    assert apiserver.secrets["rel-jwt"]["metadata"]["labels"] == {"app.kubernetes.io/instance": "rel"}
    assert apiserver.secrets["rel-jwt"]["type"] == "Opaque"
    # the upgrade's run (and every later sync): the values stay, nothing is written
    apiserver.calls.clear()
    assert main(argv, api=apiserver.api()) == 0
    assert capsys.readouterr().out.count(": kept") == 2
    assert [m for m, _ in apiserver.calls] == ["GET", "GET"]
    assert (apiserver.value("rel-redis-auth", "password"), apiserver.value("rel-jwt", "secret")) == (password, key)
    # another release's run makes values of its own
    assert main(["other-jwt/secret"], api=apiserver.api()) == 0
    assert apiserver.value("other-jwt", "secret") != key


def test_a_secret_without_the_key_the_pods_read_is_reported_and_never_changed(apiserver, capsys):
    apiserver.secrets["rel-jwt"] = {"metadata": {"name": "rel-jwt"}, "data": {"other": "eA=="}}
    assert main(["rel-jwt/secret"], api=apiserver.api()) == 1
    err = capsys.readouterr().err
    assert "rel-jwt" in err and "'secret'" in err and "never changed" in err
    assert apiserver.secrets["rel-jwt"]["data"] == {"other": "eA=="}
    assert [m for m, _ in apiserver.calls] == ["GET"]


def test_a_secret_made_by_a_concurrent_run_keeps_that_runs_value(apiserver, capsys):
    apiserver.conflict_on_create.add("rel-jwt")
    assert ensure_secrets(apiserver.api(), {"rel-jwt": ["secret"]}, {}) == {"rel-jwt": "created elsewhere"}
    assert apiserver.value("rel-jwt", "secret") == "theirs"


def test_a_refused_call_fails_with_the_api_servers_answer(apiserver, capsys):
    assert main(["rel-jwt/secret"], api=apiserver.api(token="wrong")) == 1
    err = capsys.readouterr().err
    assert "reading Secret rel-jwt: HTTP 401 Unauthorized" in err
    assert not apiserver.secrets


def test_bad_arguments_are_refused_before_any_call(apiserver, capsys):
    for argv in (["rel-jwt"], ["/secret"], ["rel-jwt/"], ["rel-jwt/secret", "--label=novalue"]):
        assert main(argv, api=apiserver.api()) == 1, argv
        assert "expected" in capsys.readouterr().err
    assert apiserver.calls == []
    assert parse_wanted(["a/x", "a/y", "a/x", "b/z"]) == {"a": ["x", "y"], "b": ["z"]}


def test_in_cluster_settings_come_from_the_pods_service_account(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(RuntimeError, match="KUBERNETES_SERVICE_HOST"):
        ApiServer.in_cluster(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    with pytest.raises(RuntimeError, match="service-account token is not mounted"):
        ApiServer.in_cluster(tmp_path)
    # a CA the context loads (the module never sends a request here)
    import ssl
    ca = ssl.get_default_verify_paths().cafile
    if not ca:
        pytest.skip("no system CA file to stand in for the cluster's CA")
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "namespace").write_text(NAMESPACE + "\n")
    (tmp_path / "ca.crt").write_bytes(open(ca, "rb").read())
    api = ApiServer.in_cluster(tmp_path)
    assert (api.url, api.token, api.namespace) == ("https://10.96.0.1:6443", TOKEN, NAMESPACE)
    assert api.context is not None and api.context.verify_mode == ssl.CERT_REQUIRED
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert ApiServer.in_cluster(tmp_path).url == "https://[fd00::1]:6443"
    with pytest.raises(ValueError, match="https://"):  # urllib would open a file: URL
        ApiServer("file:///etc", TOKEN, NAMESPACE, None)
