"""Creates the chart's Secrets inside the cluster when they are missing (the Helm chart's `secrets.generateInCluster`).

Helm keeps a generated Secret across `helm upgrade` by reading the live one (`lookup`), which `helm template` and Argo
CD cannot do: there every render made a new random value, so each sync would rotate the Redis password and the HS256
secret. With `secrets.generateInCluster`, the chart renders no secret value at all; a pre-install / pre-upgrade hook
Job runs this module, which creates each named Secret with a random value ONLY if no Secret of that name exists, and
never reads or changes an existing one. The rendered manifests are then the same on every render, and the values
live only in the cluster.

    python -m inferscale_server.k8s_secrets NAME/KEY [NAME/KEY ...] [--label K=V ...]

It talks to the API server as the pod's service account (the in-cluster token, CA and namespace files), with the
standard library only, and needs `get` and `create` on Secrets in its namespace (the chart's Role). A Secret created
by a concurrent run (HTTP 409) counts as created. Exit status 0 when every Secret exists afterwards; 1 with the
reason otherwise (the hook fails and Helm stops the install before any pod references a missing Secret).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import ssl
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
VALUE_BYTES = 36  # random bytes per value: 48 URL-safe characters, as the chart's randAlphaNum 48 before
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ApiServer:
    """Where the API server is and how to authenticate to it."""
    url: str                          # https://host:port
    token: str
    namespace: str
    context: ssl.SSLContext | None    # None: the system's CAs (a test's plain http server: no TLS at all)

    @classmethod
    def in_cluster(cls, account: Path = SERVICE_ACCOUNT) -> ApiServer:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("KUBERNETES_SERVICE_HOST is not set: this runs in a pod of the cluster (the chart's "
                               "secret-init Job)")
        try:
            token = (account / "token").read_text().strip()
            namespace = (account / "namespace").read_text().strip()
        except OSError as e:
            raise RuntimeError(f"the pod's service-account token is not mounted ({e}): the chart's Job mounts it "
                               "(automountServiceAccountToken)") from None
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        return cls(f"https://{host}:{port}", token, namespace,
                   ssl.create_default_context(cafile=str(account / "ca.crt")))

    def __post_init__(self):
        if not self.url.startswith(("https://", "http://")):  # never file: or another scheme urllib would open
            raise ValueError(f"the API server's URL must be https:// (http:// for a local stand-in), got {self.url!r}")

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={  # noqa: S310 - checked
            "Authorization": f"Bearer {self.token}", "Accept": "application/json",
            **({"Content-Type": "application/json"} if data is not None else {})})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self.context) as r:  # noqa: S310 - checked
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:
                return e.code, {}


def parse_wanted(items: list[str]) -> dict[str, list[str]]:
    """["name/key", ...] -> {name: [keys]}; names and keys as Kubernetes allows them."""
    wanted: dict[str, list[str]] = {}
    for item in items:
        name, sep, key = item.partition("/")
        if not sep or not name or not key:
            raise ValueError(f"{item!r}: expected NAME/KEY")
        wanted.setdefault(name, [])
        if key not in wanted[name]:
            wanted[name].append(key)
    return wanted


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"{item!r}: expected KEY=VALUE")
        labels[k] = v
    return labels


def ensure_secrets(api: ApiServer, wanted: dict[str, list[str]], labels: dict[str, str]) -> dict[str, str]:
    """Creates each Secret of `wanted` that does not exist, with a random value for each of its keys. Returns
    {name: "created" | "kept" | "created elsewhere"}; raises RuntimeError naming the Secret and the API's answer
    when one can be neither found nor created, or when an existing one lacks a key the pods read (it is never
    changed: a value the cluster already uses must not be replaced behind its users)."""
    done: dict[str, str] = {}
    base = f"/api/v1/namespaces/{api.namespace}/secrets"
    for name, keys in wanted.items():
        status, live = api.call("GET", f"{base}/{name}")
        if status == 200:
            missing = [k for k in keys if k not in (live.get("data") or {})]
            if missing:
                raise RuntimeError(f"Secret {name} exists without the key(s) {missing} that the pods read: add them, "
                                   "or delete the Secret to have a new one made (it is never changed here)")
            done[name] = "kept"
            continue
        if status != 404:
            raise RuntimeError(f"reading Secret {name}: HTTP {status} {live.get('message', '')}".rstrip())
        data = {k: base64.b64encode(secrets.token_urlsafe(VALUE_BYTES).encode()).decode() for k in keys}
        status, answer = api.call("POST", base, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                                 "metadata": {"name": name, "labels": labels}, "data": data})
        if status == 201:
            done[name] = "created"
        elif status == 409:  # made by a concurrent run meanwhile: that one's value stands
            done[name] = "created elsewhere"
        else:
            raise RuntimeError(f"creating Secret {name}: HTTP {status} {answer.get('message', '')}".rstrip())
    return done


def main(argv: list[str] | None = None, api: ApiServer | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inferscale_server.k8s_secrets",
                                 description="Create the chart's Secrets in this namespace when they are missing.")
    ap.add_argument("secrets", nargs="+", metavar="NAME/KEY", help="a Secret and a key to fill with a random value")
    ap.add_argument("--label", action="append", default=[], metavar="K=V", help="a label of each Secret created")
    args = ap.parse_args(argv)
    try:
        wanted, labels = parse_wanted(args.secrets), parse_labels(args.label)
        done = ensure_secrets(api or ApiServer.in_cluster(), wanted, labels)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, what in done.items():
        print(f"Secret {name}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
