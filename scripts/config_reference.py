#!/usr/bin/env python
"""Writes docs/config.md, the configuration reference, from the code itself: `inferscale serve`'s flags (its argparse
parser), ServiceConfig and the dataclasses of its nested settings (fields, defaults, the comments beside them), the
API's Limits, the chart's values.yaml (keys, defaults, comments), the environment variables the code reads (found by
scanning inferscale_core/, services/ and inferscale_client/) and the error reasons the services raise; then the
fixed sections (supported / not supported, troubleshooting, upgrade notes), whose citations are checked against the
code when the file is generated.

    python scripts/config_reference.py > docs/config.md     # regenerate
    python scripts/config_reference.py --check              # exit 1, naming what differs, if docs/config.md is stale

Nothing here starts Ray, vLLM or a model: it imports the modules that define the settings and reads sources.
tests/unit/test_config_reference.py runs --check's comparison.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "config.md"
CHART_VALUES = REPO / "charts" / "inferscale" / "values.yaml"
SCANNED = ("inferscale_core", "services", "inferscale_client")  # services/ is the package inferscale_server
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MISSING_NOTE = "(not described: add it to {table} in scripts/config_reference.py)"


# ------------------------------------------------------------------------------------------ markdown helpers
def cell(text: object) -> str:
    """One table cell: a single line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|") or "—"


def code(text: object) -> str:
    text = str(text)
    return f"``{text}``" if "`" in text else f"`{text}`"


def table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out


def rel(path: Path) -> str:
    return path.resolve().relative_to(REPO).as_posix()


def source_of(path: str) -> str:
    return (REPO / path).read_text()


def cite(path: str, symbol: str, contains: str | None = None) -> str:
    """`path` `symbol`, after checking that `symbol` (a function, class or `Class.method`) is defined in `path` and,
    if given, that `contains` is in its source: a hand-written sentence that cites code fails to generate, instead
    of going stale, when the code moves."""
    tree = ast.parse(source_of(path))
    node: ast.AST | None = tree
    for part in symbol.split("."):
        node = next((n for n in ast.iter_child_nodes(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                              ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise SystemExit(f"config_reference: {path} defines no {symbol} (a fixed section cites it)")
    if contains is not None and contains not in (ast.get_source_segment(source_of(path), node) or ""):
        raise SystemExit(f"config_reference: {path} {symbol} no longer contains {contains!r} (a fixed section says so)")
    return f"{code(path)} `{symbol}`"


# ------------------------------------------------------------------------------------------ inferscale serve
def serve_parser() -> argparse.ArgumentParser:
    """The `serve` subparser exactly as `inferscale` builds it (inferscale_core/cli.py main mounts
    inferscale_server.cli.add_commands on its subparsers)."""
    from inferscale_server import cli as service_cli

    parser = argparse.ArgumentParser(prog="inferscale")
    sub = parser.add_subparsers(dest="command", required=True)
    service_cli.add_commands(sub)
    return sub.choices["serve"]


def serve_flags() -> list[tuple[str, str, str]]:
    rows = []
    for action in serve_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        takes_value = action.nargs != 0
        value = ""
        if takes_value:
            value = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices
                                       else action.dest.upper())
        flag = " / ".join(action.option_strings) + (f" {value}" if value else "")
        if not takes_value:
            default = "off" if not action.default else "on"
        else:
            default = "none" if action.default is None else code(action.default)
        text = (action.help or "") % {"default": action.default, "prog": "inferscale serve"}
        if action.choices and takes_value:
            text = f"{text} (one of: {', '.join(map(str, action.choices))})".strip()
        if takes_value and getattr(action.type, "__name__", "") in ("int", "float", "_positive_int",
                                                                    "_positive_float"):
            kind = {"int": "an integer", "float": "a number", "_positive_int": "an integer >= 1",
                    "_positive_float": "a number > 0"}[action.type.__name__]
            text = f"{text} ({kind})".strip()
        rows.append((code(flag), default, text))
    return rows


# ------------------------------------------------------------------------------------------ dataclass fields
def field_docs(cls) -> dict[str, str]:
    """Each field's comment: the `#` lines right above it (no blank line between) and the comment at the end of
    its line(s), or a string right after it. A field with none that the comment block above an earlier field names
    (`kv_dir`'s block names `store_options`) shares that block."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments: dict[int, str] = {}  # line number -> comment text
    own_line: set[int] = set()     # lines that hold a comment and nothing else
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not lines[tok.start[0] - 1][:tok.start[1]].strip():
                own_line.add(tok.start[0])
    body = ast.parse(src).body[0].body
    docs: dict[str, str] = {}
    blocks: list[str] = []
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, n = [], node.lineno - 1
        while n in own_line:
            above.insert(0, comments[n])
            n -= 1
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments and n not in own_line]
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            trailing.append(inspect.cleandoc(after.value.value))
        name = node.target.id
        text = " ".join(above + trailing)
        if not text:  # the sentences of an earlier block that name this field
            for block in reversed(blocks):
                named = [s for s in re.split(r"(?<=\.)\s+", block) if re.search(rf"\b{re.escape(name)}\b", s)]
                if named:
                    text = " ".join(named)
                    break
        if not text and cls.__doc__:  # the class docstring's "`name`: ..." part
            m = re.search(rf"`{re.escape(name)}`: (.*?)(?=\s`\w+`: |\Z)", " ".join(cls.__doc__.split()))
            text = m.group(1) if m else ""
        if above:
            blocks.append(" ".join(above))
        docs[name] = text
    return docs


def default_text(cls, f: dataclasses.Field) -> str:
    """The default as the code has it: the value (and the expression, where the source computes it), `{}` / `[]`
    for an empty container factory, the factory's source otherwise; `(required)` where there is none."""
    if f.default is not dataclasses.MISSING:
        value = f.default
        expr = _default_expr(cls, f.name)
        shown = code(repr(value))
        if expr and re.search(r"[<*+/-]", expr) and not expr.lstrip("-").replace("_", "").replace(".", "").isdigit():
            shown += f" ({code(expr)})"
        return shown
    if f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        if factory in (dict, list, tuple, set):
            return code(repr(factory()))
        expr = _default_expr(cls, f.name) or getattr(factory, "__name__", "a factory")
        return f"computed: {code(expr)}"
    return "(required)"


def _default_expr(cls, name: str) -> str:
    src = textwrap.dedent(inspect.getsource(cls))
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            value = node.value
            if (isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field"):
                kw = {k.arg: k.value for k in value.keywords}
                value = kw.get("default") or kw.get("default_factory")
            return ast.get_source_segment(src, value) if value is not None else ""
    return ""


def dataclass_rows(cls) -> list[tuple[str, str, str, str]]:
    docs = field_docs(cls)
    return [(code(f.name), code(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", f.type)),
             default_text(cls, f), docs.get(f.name, "")) for f in dataclasses.fields(cls)]


# ------------------------------------------------------------------------------------------ chart values
def _split_comment(line: str) -> tuple[str, str]:
    """(content, trailing comment) of a YAML line: the first ` #` outside quotes starts the comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def _commented_out_entry(text: str) -> bool:
    """A comment that is a YAML entry left out (`hostPath: {path: ...}`), not prose."""
    import yaml

    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(parsed, dict) and len(parsed) == 1 and isinstance(next(iter(parsed.values())), (dict, list))


def chart_comments(text: str) -> tuple[str, dict[tuple[str, ...], str]]:
    """The file's opening comment, and each key path's comment (the `#` lines right above it, then the one at the end
    of its line), by a line scan with an indentation stack. A commented-out entry is added to the key before it as
    an alternative, not to the key after it."""
    lines = text.splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    docs: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    last: tuple[str, ...] | None = None
    for line in lines[len(header):]:
        stripped = line.strip()
        if not stripped:
            block = []
            continue
        if stripped.startswith("#"):
            comment = stripped.lstrip("#").strip()
            if _commented_out_entry(comment) and last is not None:
                docs[last] = f"{docs.get(last, '')} Commented-out alternative: {code(comment)}.".strip()
            else:
                block.append(comment)
            continue
        content, trailing = _split_comment(line)
        m = re.match(r"^(\s*)([^\s#'\"\-][^:]*?|\"[^\"]+\"|'[^']+'):(\s|$)", content)
        if not m:  # a list item or a continuation: belongs to the key above
            block = []
            continue
        indent, key = len(m.group(1)), m.group(2).strip("'\"")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(k for _, k in stack) + (key,)
        stack.append((indent, key))
        docs[path] = " ".join(block + ([trailing] if trailing else []))
        block, last = [], path
    return " ".join(header), docs


def helm_key(path: tuple[str, ...]) -> str:
    return ".".join(k.replace(".", "\\.") for k in path)  # helm --set's escaping of a dot inside a key


def chart_rows() -> tuple[str, list[tuple[str, str, str]]]:
    import yaml

    text = CHART_VALUES.read_text()
    values = yaml.safe_load(text)
    header, docs = chart_comments(text)
    rows: list[tuple[str, str, str]] = []

    def walk(node, path: tuple[str, ...]):
        for key, value in node.items():
            p = path + (str(key),)
            if isinstance(value, dict) and value:
                if docs.get(p):
                    rows.append((code(helm_key(p)), "(map: the keys below)", docs[p]))
                walk(value, p)
            else:
                rows.append((code(helm_key(p)), code(json.dumps(value)), docs.get(p, "")))

    walk(values, ())
    return header, rows


# ------------------------------------------------------------------------------------------ environment variables
ENV_MEANINGS = {
    "INFERSCALE_CACHE": "The InferScale cache folder: converted models, the local development JWT secret, "
                        "`inferscale serve`'s default `--kv-dir` (`<cache>/kv`), the demo's log, Mem0's files. "
                        "Default `$XDG_CACHE_HOME/inferscale`.",
    "XDG_CACHE_HOME": "Parent of the InferScale cache when `INFERSCALE_CACHE` is unset (default `~/.cache`).",
    "KUBERNETES_SERVICE_HOST": "Set by Kubernetes in every pod: the API server the chart's secret-init Job "
                               "(`python -m inferscale_server.k8s_secrets`, `secrets.generateInCluster`) creates the "
                               "missing Secrets through; unset, it refuses to run.",
    "KUBERNETES_SERVICE_PORT": "Set by Kubernetes in every pod: the API server's port for the secret-init Job.",
    "HF_HUB_OFFLINE": "Set to 1 where unset before a model or the embedder loads: the models are local folders, "
                      "nothing is downloaded from the Hugging Face hub.",
    "POD_IP": "The address this process's Mooncake client advertises to the other clients (the chart sets it to "
              "the pod's IP); default `127.0.0.1`.",
    "INFERSCALE_TARGET": "The client's server address (`inferscale_client`, the `inferscale` client commands' "
                         "`--target`); default `localhost:9000`.",
    "INFERSCALE_TOKEN": "The client's bearer token (`inferscale_client`, the `inferscale` client commands' "
                        "`--token`).",
    "INFERSCALE_GRPC_HOST": "The address Serve's gRPC proxy binds (`inferscale serve` sets it to `--host`; Serve's "
                            "own default binds every interface). Read by the proxy callback, services/proxy_setup.py.",
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": "Ray Serve's gRPC message limit; the HTTP proxy's body limit "
                                       "(services/proxy_setup.py) reads the same value, so one transport limit "
                                       "holds on both doors. Set by the project (below).",
    "INFERSCALE_HTTP_BODY_TIMEOUT_S": "Seconds an HTTP client has to send its whole request body; Serve's HTTP "
                                      "proxy reads it before the request reaches a replica and answers 408 after "
                                      "them (services/proxy_setup.py). Read by every proxy process: set it where "
                                      "Ray starts (the environment of `ray start`, or the runtime_env).",
    "INFERSCALE_JWT_SECRET": "The HS256 secret itself (a Kubernetes Secret; the chart sets it), when "
                             "`ServiceConfig.auth` names no key file.",
    "INFERSCALE_JWT_SECRET_FILE": "A file holding the HS256 secret (as `auth.hs256_secret_file`).",
    "INFERSCALE_JWT_PUBLIC_KEY_FILE": "A PEM public key (RS256/ES256) to verify tokens with (as "
                                      "`auth.public_key_file`).",
    "INFERSCALE_JWT_JWKS_URL": "A JWKS endpoint to verify tokens with (as `auth.jwks_url`).",
    "INFERSCALE_JWT_ISSUER": "The `iss` every token must carry (as `auth.issuer`): required with public keys; "
                             "HS256 tokens default to `inferscale`. `inferscale token` and the CLI mint with it.",
    "INFERSCALE_JWT_AUDIENCE": "The `aud` every token must carry (as `auth.audience`): required with public keys; "
                               "HS256 tokens default to `inferscale`. `inferscale token` and the CLI mint with it.",
    "INFERSCALE_REDIS_PASSWORD_FILE": "A file holding Redis' password, read when the registry URL carries none and "
                                      "$INFERSCALE_REDIS_PASSWORD is unset (the chart mounts its Secret there).",
    "INFERSCALE_REDIS_PASSWORD": "Redis' password when the registry URL carries none (the chart mounts its Secret as "
                                 "a file instead: INFERSCALE_REDIS_PASSWORD_FILE).",
    "INFERSCALE_ENGINE_KV_BUDGET_BYTES": "Bytes of fact KV one engine replica keeps in its worker store (its "
                                         "resident-KV budget); default a quarter of the machine's memory times the "
                                         "replica's share of the node.",
    "INFERSCALE_ENGINE_WATCH_S": "Seconds between an engine replica's background rounds: facts found in no tier "
                                 "are re-encoded, the registry's new tombstones applied. Read at import, like the "
                                 "other INFERSCALE_ENGINE_* and INFERSCALE_RETRIEVAL_* variables: on Kubernetes set "
                                 "them in the chart's `ray.extraEnv`.",
    "INFERSCALE_ENGINE_MAX_USERS": "Users one engine replica holds at once (Serve's multiplexed models per "
                                   "replica, Serve's LRU); beyond it the least recently used user is unloaded.",
    "INFERSCALE_RETRIEVAL_MAX_USERS": "Users one retrieval replica keeps an index for at once (least recently used "
                                      "dropped beyond it).",
    "INFERSCALE_RETRIEVAL_MAX_INDEX_BYTES": "Bytes of embeddings one retrieval replica keeps (facts x 384 x 4 B; a "
                                            "100,000-fact user ~150 MB): beyond it the least recently used users' "
                                            "indices are dropped, and rebuilt from the registry's stored embeddings "
                                            "at their next search. A whole number >= 1; default 2 GiB.",
    "MEM0_TELEMETRY": "Mem0's telemetry to PostHog: set to `false` where unset before mem0 is imported (the service "
                      "never phones home).",
    "MEM0_DIR": "Mem0's own files: set to `<InferScale cache>/mem0` where unset.",
}


class _EnvScan(ast.NodeVisitor):
    """Reads of the environment in one module: os.environ.get / [] / setdefault / pop, os.getenv, `in os.environ`;
    the name as a literal, a module constant, or an entry of a constant dict (every entry when the key varies)."""

    def __init__(self, path: str, tree: ast.Module, constants: dict[str, object]):
        self.path, self.constants = path, constants
        self.found: list[tuple[str, str, object]] = []      # (name, how, default)
        self.unresolved: list[tuple[str, str]] = []         # (path, function)
        self.local: dict[str, object] = _module_constants(tree)
        self.function = "<module>"

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def _names(self, node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Name):
            value = self.local.get(node.id, self.constants.get(node.id))
            return [value] if isinstance(value, str) else []
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            table_ = self.local.get(node.value.id, self.constants.get(node.value.id))
            if isinstance(table_, dict):
                key = node.slice
                if isinstance(key, ast.Constant) and key.value in table_:
                    return [table_[key.value]]
                return [v for v in table_.values() if isinstance(v, str)]
        return []

    def _default(self, node: ast.AST | None) -> object:
        if node is None:
            return None
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.local.get(node.id, self.constants.get(node.id, node.id))
        return None

    def _record(self, key: ast.AST, how: str, default: ast.AST | None = None):
        names = self._names(key)
        if not names:
            self.unresolved.append((self.path, self.function))
        for name in names:
            self.found.append((name, how, self._default(default)))

    def visit_Call(self, node: ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and node.args:
            owner = func.value
            if _is_environ(owner) and func.attr in ("get", "setdefault", "pop"):
                how = "set if unset" if func.attr == "setdefault" else "read"
                self._record(node.args[0], how, node.args[1] if len(node.args) > 1 else None)
            elif func.attr == "getenv" and isinstance(owner, ast.Name) and owner.id == "os":
                self._record(node.args[0], "read", node.args[1] if len(node.args) > 1 else None)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript):
        if _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            self._record(node.slice, "read")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare):
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) and _is_environ(node.comparators[0]):
            self._record(node.left, "read")
        self.generic_visit(node)


def _is_environ(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
             and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ"))


def _module_constants(tree: ast.Module) -> dict[str, object]:
    """Module-level NAME = <literal> (also A, B = <literal>, <literal>)."""
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is None:
                continue
            try:
                value = _literal(node.value)
            except (ValueError, SyntaxError, TypeError):
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    out[target.id] = value
                elif isinstance(target, ast.Tuple) and isinstance(value, tuple) and len(value) == len(target.elts):
                    out.update({t.id: v for t, v in zip(target.elts, value) if isinstance(t, ast.Name)})
    return out


def _literal(node: ast.AST) -> object:
    """ast.literal_eval, plus integer arithmetic of literals (`4 << 20`)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.Mult, ast.Add, ast.Sub)):
        left, right = _literal(node.left), _literal(node.right)
        if not (isinstance(left, int) and isinstance(right, int)):
            raise ValueError("not integer arithmetic")
        return {ast.LShift: lambda a, b: a << b, ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b,
                ast.Sub: lambda a, b: a - b}[type(node.op)](left, right)
    return ast.literal_eval(node)


def scanned_files() -> list[Path]:
    files = []
    for top in SCANNED:
        files += [p for p in (REPO / top).rglob("*.py") if "_generated" not in p.parts and "__pycache__" not in p.parts]
    return sorted(files)


def env_reads() -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """{name: {"files": [...], "how": {...}, "defaults": [...]}} of every variable the scanned code reads, and the
    reads whose name the scan cannot tell (file, function)."""
    trees = {rel(p): ast.parse(p.read_text()) for p in scanned_files()}
    constants: dict[str, object] = {}
    for tree in trees.values():
        for name, value in _module_constants(tree).items():
            constants.setdefault(name, value)
    reads: dict[str, dict] = {}
    unresolved: list[tuple[str, str]] = []
    for path, tree in trees.items():
        scan = _EnvScan(path, tree, constants)
        scan.visit(tree)
        unresolved += scan.unresolved
        for name, how, default in scan.found:
            entry = reads.setdefault(name, {"files": set(), "how": set(), "defaults": set()})
            entry["files"].add(path)
            entry["how"].add(how)
            if default is not None:
                entry["defaults"].add(str(default))
    return dict(sorted(reads.items())), sorted(set(unresolved))


def dict_literal(path: str, function: str) -> list[tuple[str, str]]:
    """(key, value) of the first dict literal in `function` of `path`: a literal value as it is, any other value as
    its expression (what it is computed from)."""
    src = source_of(path)
    func = next((n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == function), None)
    found = next((n for n in ast.walk(func) if isinstance(n, ast.Dict)), None) if func else None
    if found is None:
        raise SystemExit(f"config_reference: no dict literal in {path} {function}")
    out = []
    for key, value in zip(found.keys, found.values):
        shown = (code(value.value) if isinstance(value, ast.Constant)
                 else "computed: " + code(ast.get_source_segment(src, value)))
        out.append((ast.literal_eval(key), shown))
    return out


def env_set_by_project() -> list[tuple[str, str, str]]:
    """The variables the project puts into the environment of vLLM, OpenMP, Ray Serve and glibc: (name, value,
    where). Values computed from the machine are shown as the expression they are computed with."""
    from inferscale_server import app

    rows = []
    for name, value in dict_literal("inferscale_core/vllm_env.py", "vllm_cpu_env"):
        rows.append((code(name), f"{value}; a value already in the environment wins",
                     "`inferscale_core/vllm_env.py` `vllm_cpu_env`: vLLM on a CPU"))
    for name, value in dict_literal("inferscale_core/vllm_env.py", "engine_bind_env"):
        rows.append((code(name), value, "`inferscale_core/vllm_env.py` `engine_bind_env`: engine replicas on a "
                                        "CPU node (`engine_cpu_cores`)"))
    for name, value in app.serve_start_env("HOST").items():
        shown = "`--host` (the Serve application's host)" if value == "HOST" else code(value)
        rows.append((code(name), shown, "`services/app.py` `serve_start_env`: the Ray that Serve starts on"))
    for name, value in app.ENCODER_ENV.items():
        rows.append((code(name), code(value), "`services/app.py` `ENCODER_ENV`: the encoder pool's processes"))
    return rows


# ------------------------------------------------------------------------------------------ error reasons
REASON_MEANINGS = {
    "ENGINE_AT_CAPACITY": "The engine replica's admission: the tokens in flight (prompt + max_tokens) would pass "
                          "its KV cache times `admission_queue_factor`, or it would queue past the KV cache and "
                          "this user, who already has requests in flight, would pass its share (the limit divided "
                          "among the users with requests in flight). Retry after the hint; add engine replicas or KV cache, or raise the "
                          "factor (services/admission.py).",
    "CALLER_RATE": "This caller (token subject) is over its request rate on a gateway replica "
                   "(`requests_per_s_per_caller`, bursts of `request_burst_per_caller`). Admins are not limited. "
                   "Answered after the retry hint (`refusal_pause_max_s` at most).",
    "CALLER_CONCURRENCY": "This caller has `max_in_flight_per_caller` requests in flight on a gateway replica.",
    "CALLER_WORK": "This caller's requests have used more work than its budget of a resource this request needs, on "
                   "a gateway replica (one balance each for the gateway, the encoder pool and the engine; work "
                   "units: tokens the model forwards, `work_units_per_s_per_caller`, bursts of "
                   "`work_burst_per_caller`; the gateway's: `gateway_work_units_per_s_per_caller`, bursts of "
                   "`gateway_work_burst_per_caller`; docs/security.md): refused until that balance has refilled to zero (the "
                   "retry hint). Admins are not limited. Answered after the retry hint (`refusal_pause_max_s` at "
                   "most).",
    "EXTRACTION_QUEUE_FULL": "Too many AddMemory calls with infer=true (Mem0's extraction) wait on this gateway "
                             "replica, or this user already has its share of them in progress "
                             "(services/gateway/core.py MEM0_QUEUE, MEM0_PER_USER); retry later or send infer=false. "
                             "Answered after the retry hint (`refusal_pause_max_s` at most).",
    "EXTRACTION_STOPPED": "A Mem0 extraction (infer=true) did not finish within its time bound and was stopped; the "
                          "message says how many of its changes were written. Not retried automatically.",
    "TOO_MANY_WATCHES": "Too many open health Watch streams on this server or connection; use Check, or watch later.",
    "BACKENDS_NOT_DEPLOYED": "The call needs the retrieval and engine deployments and this gateway runs without "
                             "them (registry-only mode). A retry cannot help.",
    "FIELD_TOO_LARGE": "A field is over a size limit of Limits (the message and BadRequest name it). Never retried.",
    "REQUEST_TOO_LARGE": "The request is over `max_request_bytes` (or the transport limit). Never retried.",
    "QUOTA_EXCEEDED": "A per-user quota (facts, bytes, KV bytes of Limits) is full (QuotaFailure names it): delete "
                      "facts first. Never retried.",
    "REGISTRY_FULL": "Redis is at its maxmemory (noeviction): nothing was written; reads and deletes still work. "
                     "Delete facts or users, or give Redis more memory (chart `redis.maxmemory` and `redis.memory`).",
    "WRITE_UNCONFIRMED": "The registry could not confirm a write: its Redis master failed or stalled after the write "
                         "was sent, or no replica acknowledged it within the wait (`wait_replicas`, `wait_timeout_ms` "
                         "in the registry URL). It may have been applied: retry after the RetryInfo delay; an add "
                         "is safe to retry with its idempotency key (inferscale_client sends one), without one read "
                         "before retrying it (deploy.md, \"Failover\").",
    "IDEMPOTENCY_KEY_REUSED": "An add's idempotency key was used by an earlier add of the user with other facts "
                             "(texts, metadata, windows, times): one key names one add. Send a new key for a new "
                             "add; nothing was stored.",
    "IDEMPOTENT_ADD_DELETED": "The add with this idempotency key was applied earlier, and some of its facts have "
                             "been deleted since (the message names them); nothing was stored again.",
}


def error_reasons() -> list[tuple[str, str, str, str, str]]:
    """(reason, gRPC code, HTTP status, where, meaning) of every `reason="..."` the services raise, from their
    ApiError calls: HTTP 429 for RESOURCE_EXHAUSTED with a retry hint, else the front door's status map."""
    from inferscale_server.gateway.http_front import HTTP_STATUS

    http = {code_.name: status for code_, status in HTTP_STATUS.items()}
    found: dict[str, dict] = {}
    for path in scanned_files():
        if not rel(path).startswith("services/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            reason = kw.get("reason")
            if reason is None:
                continue
            names = [n.value for n in ast.walk(reason) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            status = next((a.attr for a in node.args if isinstance(a, ast.Attribute)
                           and getattr(a.value, "attr", "") == "StatusCode"), None)
            if not names or status is None:
                continue
            retry = "retry_after_s" in kw and not (isinstance(kw["retry_after_s"], ast.Constant)
                                                   and kw["retry_after_s"].value is None)
            for name in names:
                entry = found.setdefault(name, {"status": status, "files": set(), "retry": retry})
                entry["files"].add(rel(path))
    rows = []
    for name, e in sorted(found.items()):
        status = 429 if e["status"] == "RESOURCE_EXHAUSTED" and e["retry"] else http.get(e["status"], "")
        rows.append((code(name), e["status"], str(status), ", ".join(code(f) for f in sorted(e["files"])),
                     REASON_MEANINGS.get(name, MISSING_NOTE.format(table="REASON_MEANINGS"))))
    return rows


# ------------------------------------------------------------------------------------------ the document
def requires_python() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]


def render() -> str:
    from inferscale_core.cluster_store import ClusterConfig
    from inferscale_server.app import ServiceConfig
    from inferscale_server.auth import AuthConfig
    from inferscale_server.gateway.http_front import HttpConfig
    from inferscale_server.limits import Limits

    out: list[str] = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/config_reference.py from the code: do not edit by hand. Regenerate with",
        "     python scripts/config_reference.py > docs/config.md",
        "     (tests/unit/test_config_reference.py fails while this file differs from what the script writes.) -->",
        "",
        "InferScale's settings with their defaults, taken from the code: `inferscale serve`'s flags, the "
        "application's settings (`ServiceConfig`, the `args` of a Serve config), the API's limits, the Helm "
        "chart's values and the environment variables the code reads; then what is supported, troubleshooting by "
        "error reason, and upgrade notes. How the pieces fit: [deploy.md](deploy.md); security: "
        "[security.md](security.md).",
        "",
    ]
    flags = serve_flags()
    out += ["## `inferscale serve` flags", "",
            f"{len(flags)} flags of `inferscale serve` (services/cli.py `add_commands`; `inferscale serve --help` "
            "prints the same). `serve` runs the whole service on one machine: a local Ray, the four deployments at "
            "one replica each, the embedded model unless `--model` names another.", ""]
    out += table(("flag", "default", "what it does"), flags) + [""]

    svc = dataclass_rows(ServiceConfig)
    out += ["## Application settings (`ServiceConfig`)", "",
            f"{len(svc)} fields of `ServiceConfig` (services/app.py). A Serve config's `args` (and "
            "`ServiceConfig.from_args`) take all of them except `deployments`, `http_port` and `grpc_port`; the "
            "chart sets them from its values (`ServiceConfig.from_chart_values`), `inferscale serve` from its "
            "flags. Unknown keys are refused by name.", ""]
    out += table(("field", "type", "default", "what it does"), svc) + [""]
    for title, cls, where in (("`ServiceConfig.auth`", AuthConfig, "services/auth.py `AuthConfig`"),
                              ("`ServiceConfig.http`", HttpConfig, "services/gateway/http_front.py `HttpConfig`"),
                              ("`ServiceConfig.cluster_store`", ClusterConfig,
                               "inferscale_core/cluster_store.py `ClusterConfig`")):
        rows = dataclass_rows(cls)
        out += [f"### {title}", "", f"{len(rows)} keys ({where}); unknown keys are refused by name.", ""]
        out += table(("key", "type", "default", "what it does"), rows) + [""]

    limits = dataclass_rows(Limits)
    out += ["## API limits (`Limits`)", "",
            f"{len(limits)} limits (services/limits.py `Limits`), the same on gRPC, the OpenAI door and Mem0's door. "
            "Override them with `ServiceConfig.limits` or the chart's `limits` (e.g. `max_fact_chars: 4000`); a "
            "misspelled name is refused when the application is built. Over a size bound: RESOURCE_EXHAUSTED "
            "(HTTP 413); out of a range: INVALID_ARGUMENT (400).", ""]
    out += table(("limit", "type", "default", "what it bounds"), limits) + [""]

    header, chart = chart_rows()
    out += ["## Helm chart values", "",
            f"{len(chart)} keys of charts/inferscale/values.yaml, flattened to the dotted form `helm --set` takes "
            "(a dot inside a key is escaped as `\\.`); lists and maps shown as JSON; a map with its own comment has "
            "a row too. The comments are the file's own.", "", f"> {header}", ""]
    out += table(("key", "default", "what it does"), chart) + [""]

    reads, unresolved = env_reads()
    rows = []
    for name, e in reads.items():
        how = " and ".join(sorted(e["how"]))
        default = ", ".join(code(d) for d in sorted(e["defaults"])) or "—"
        rows.append((code(name), how, default, ", ".join(code(f) for f in sorted(e["files"])),
                     ENV_MEANINGS.get(name, MISSING_NOTE.format(table="ENV_MEANINGS"))))
    out += ["## Environment variables", "",
            f"{len(rows)} variables the code reads, found by scanning {', '.join(f'{s}/' for s in SCANNED)} for "
            "`os.environ.get(...)`, `os.environ[...]`, `os.environ.setdefault(...)`, `os.getenv(...)` and "
            "`... in os.environ` (a name given as a literal or as a module constant). \"set if unset\": the code "
            "puts its value there unless the environment has one.", ""]
    out += table(("variable", "how", "default in the code", "read in", "what it does"), rows) + [""]
    if unresolved:
        out += ["Also read through a name the scan does not resolve: "
                + "; ".join(f"{code(p)} `{fn}`" for p, fn in unresolved)
                + " (`vllm_cpu_env` reads each variable it sets, in the table below: a value already in the "
                  "environment wins).", ""]
    set_rows = env_set_by_project()
    out += ["### Set by the project", "",
            f"{len(set_rows)} variables the project puts into the environment of vLLM, OpenMP, Ray Serve and glibc. "
            "vLLM's own `VLLM_*` variables (and the OpenMP and Hugging Face ones beside them) are defined once in "
            "inferscale_core/vllm_env.py: `vllm_cpu_env` for vLLM on a CPU (`inferscale serve`, the demo, the "
            "benchmarks; `serve` sets `VLLM_CPU_KVCACHE_SPACE` from `--kv-cache-gib`, else keeps a value already "
            "set, else an eighth of the machine), `engine_bind_env` for engine replicas on a CPU node: their "
            "own cores when several split it (`ServiceConfig.engine_cpu_cores`), else every core but the one "
            "left to the light work (`cores_beside_light_work`). Any other `VLLM_*` variable is vLLM's own and passes "
            "through (on Kubernetes: the chart's `ray.extraEnv`). `serve_start_env` is what `inferscale serve` "
            "gives its local Ray; the chart and ray_cluster.yaml set the same `RAY_SERVE_*` values for theirs "
            "(`SERVE_START_ENV`; tests/packaging/test_chart.py and tests/service/ray_nodes/test_ray_cluster.py check they agree); `ENCODER_ENV` goes into the encoder "
            "pool's runtime_env.", ""]
    out += table(("variable", "value", "set by"), set_rows) + [""]

    out += fixed_sections()
    return "\n".join(out).rstrip() + "\n"


def fixed_sections() -> list[str]:
    tp = cite("inferscale_core/connector_worker.py", "WorkerSide.__init__", "tensor_parallel_size != 1")
    local_mooncake = cite("services/cli.py", "local_cluster_tier", "every interface")
    fingerprint = cite("inferscale_core/cluster_store.py", "kv_fingerprint")
    disk_dir = cite("services/engine_replica/placement.py", "replica_disk_dir", 'f"kv-{fingerprint}"')
    admission = cite("services/admission.py", "EngineAtCapacity")
    caller = cite("services/gateway/principal_limits.py", "PrincipalLimits")
    work = cite("services/gateway/work_budget.py", "WorkBudget")
    full = cite("services/errors.py", "registry_full")
    redis_cluster = cite("services/registry/redis_backend.py", "RedisRegistry._probe", "cluster_enabled")
    buckets = cite("services/registry/redis_backend.py", "bucket_of")
    overload = cite("services/gateway/http_common.py", "is_overload")
    reasons = error_reasons()
    out = ["## Supported / not supported", "",
           f"- **One engine per GPU.** No tensor or pipeline parallelism: the connector refuses "
           f"`tensor_parallel_size` or `pipeline_parallel_size` other than 1 when vLLM starts ({tp}): its fact "
           "store holds every KV head of every layer. Scale out with engine replicas (one per GPU), not with "
           "bigger engines.",
           f"- **Python {requires_python()}** (pyproject.toml `requires-python`): Python 3.11 only, as the images "
           "and `scripts/bootstrap.sh` install it.",
           "- **Measured on CPUs; the GPU path is not measured through vLLM yet.** Every service and accuracy "
           "number in BENCHMARKS.md comes from a CPU (vllm-cpu). Its only GPU numbers (\"First GPU numbers\": an "
           "H200, transformers with random weights, no vLLM) measure the injection against prompt injection "
           "outside vLLM; exactness and TTFT inside vLLM on CUDA (bench/gpu.md steps 1-2) have not run.",
           f"- **`inferscale serve --local-mooncake` listens on every interface**: the Mooncake Store it starts "
           f"(master on loopback, one segment) has transfer and handshake ports that no flag binds ({local_mooncake}). "
           "Use it on a machine no untrusted network reaches; without it, `serve` binds nothing beyond `--host` "
           "except Ray's own ports (docs/deploy.md, \"Known limits\"). Mooncake and Ray on one machine carry no "
           "authentication; on Kubernetes the chart's NetworkPolicies (`networkPolicy.*`) and KubeRay's token auth "
           "(`ray.authToken`) cover them.",
           f"- **Redis: one server or a Redis Cluster** ({redis_cluster}): a registry URL naming any node of a "
           "cluster (database 0) gives a cluster client; every key of a user carries its bucket's hash tag "
           f"({buckets}), so each operation touches one slot (docs/deploy.md, \"The registry on Redis "
           "Cluster\"). Tested on 3 masters without replicas; failover and slot migration under writes are not "
           "tested. Redis Sentinel URLs are not supported.",
           "",
           "## Troubleshooting", "",
           f"**RESOURCE_EXHAUSTED / HTTP 429 with Retry-After: at capacity or over a caller's share.** A refusal "
           f"that a retry may get past carries a retry hint (google.rpc RetryInfo; `Retry-After` on HTTP, "
           f"{overload}); the light client retries it within the call's deadline. The engine replica refuses what "
           f"does not fit its KV cache times `admission_queue_factor` ({admission}); each gateway replica bounds "
           f"every caller (token subject) by `max_in_flight_per_caller` and `requests_per_s_per_caller` "
           f"({caller}), and by the work its requests cause, `work_units_per_s_per_caller` ({work}). Without a hint (a request or field too large, a per-user quota) RESOURCE_EXHAUSTED is "
           "HTTP 413 and is never retried.",
           "",
           f"**UNAVAILABLE `REGISTRY_FULL`: Redis is at its maxmemory** ({full}). The chart's Redis refuses writes "
           "(noeviction: it never drops a fact) at `redis.maxmemory`, below its pod's memory limit; reads and "
           "deletes still work, Health's registry component says full. Delete facts or users, or raise "
           "`redis.maxmemory` with `redis.memory`.",
           "",
           "**Memory at many users x large k.** Every engine replica holds vLLM's KV cache, its resident fact KV "
           "(`INFERSCALE_ENGINE_KV_BUDGET_BYTES`, default a quarter of the machine) and the users it serves; on a "
           "CPU `inferscale serve` gives vLLM an eighth of the machine per engine (`--kv-cache-gib`). BENCHMARKS.md "
           "(\"Service under load\", run A) ran a 24 GB machine out of memory at 100 users x k=50 with two engine "
           "replicas at the defaults (Ray's memory monitor killed workers); 2 GiB of KV cache per engine served "
           "all requests. Size the KV cache and the budgets per engine, not per machine (docs/deploy.md, "
           "\"Sizing\" and \"How much KV a fact, a user and a tier hold\").",
           "",
           "**The first request with a JSON schema is slow.** `response_format` `json_schema` / `json_object`, "
           "forced tool calls and Mem0's extraction use vLLM's structured outputs: the first such request compiles "
           "its grammar (10-25 s on 2 CPU cores, docs/deploy.md), later ones with the same schema do not.",
           "",
           f"**Every error reason.** {len(reasons)} stable `reason` names the services raise (google.rpc ErrorInfo "
           "on gRPC; the OpenAI door's error `code`, in lower case, on a 429), found by scanning services/ for "
           "`reason=`. A refusal with no reason of its own carries its status code's name.",
           ""]
    out += table(("reason", "gRPC status", "HTTP", "raised in", "meaning, what to do"), reasons) + [""]
    out += ["## Upgrade notes", "",
            f"- **What invalidates stored KV.** A fact's KV depends on the model (its config.json and the names and "
            f"sizes of its weight files), the stored dtype and the instruction prefix it is encoded behind: the "
            f"fingerprint of {fingerprint}. Changing any of them (another model or model files, `model.dtype`, an "
            "InferScale version whose instruction prefix differs) makes every stored KV unusable: the cluster tier's objects are keyed by the fingerprint "
            "and are simply not found, and each fact is encoded again on its next use.",
            f"- **The engine replica's disk tier is keyed by it**: `{{kv_dir}}/{{app}}/{{deployment}}/slot-{{rank}}/"
            f"kv-{{fingerprint}}` ({disk_dir}). After a configuration change a replica starts an empty folder "
            "beside the old one, names the other configurations' folders in a warning and leaves them (switching "
            "back finds them); delete them to free the disk. A disk tier written before this layout "
            "(`slot-{rank}` without the `kv-{fingerprint}` folder) is not read.",
            "- **Facts are re-encoded from the registry on demand**: KV is derived data. The registry holds every "
            "fact's text, window and metadata, so a fact whose KV is in no tier is encoded once when a request "
            "needs it (a user's first request after an upgrade pays those encodes).",
            "- **The registry in Redis is kept across upgrades** (the chart's Redis StatefulSet and its Secret "
            "are kept by `helm upgrade`): facts, ids, versions and history survive; only KV is rebuilt. A "
            "registry written before the per-bucket key layout (development builds before Redis Cluster support: "
            "keys `fact:<id>`, `seq`, `tombstones`) is not read: start from an empty Redis or another key prefix.",
            "- **Facts stored before the owners index** (`{b<N>}:owners/<id>`, written with each fact since Mem0's "
            "no-auth calls by memory id: docs/mem0.md) are not found by their id alone on a server without "
            "authentication; `?user_id=` finds them, and everything else reads them as before.",
            ""]
    return out


# ------------------------------------------------------------------------------------------ main
def stale_report(committed: str, generated: str) -> str:
    """What differs, line by line: rows only in the code name the missing flag, field, value or variable."""
    old, new = committed.splitlines(), generated.splitlines()
    missing = [ln for ln in new if ln not in set(old)]
    extra = [ln for ln in old if ln not in set(new)]
    parts = ["docs/config.md is stale; regenerate it: python scripts/config_reference.py > docs/config.md"]
    if missing:
        parts.append("in the code, not in docs/config.md:\n" + "\n".join(f"  + {ln[:200]}" for ln in missing[:40]))
    if extra:
        parts.append("in docs/config.md, no longer in the code:\n" + "\n".join(f"  - {ln[:200]}" for ln in extra[:40]))
    if not missing and not extra:
        parts.append("\n".join(difflib.unified_diff(old, new, "docs/config.md", "generated", lineterm="", n=1)))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="compare docs/config.md with what the code generates; exit 1 naming what differs")
    args = parser.parse_args(argv)
    generated = render()
    if args.check:
        committed = DOC.read_text() if DOC.exists() else ""
        if committed != generated:
            print(stale_report(committed, generated), file=sys.stderr)
            return 1
        print("docs/config.md is up to date")
        return 0
    sys.stdout.write(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
