"""The client commands of `inferscale` (gRPC; this module needs only grpcio and protobuf):

    inferscale add USER FACT [FACT ...]         store facts as they are
    inferscale ask USER QUESTION                answer with the user's memory injected (streams)
    inferscale list USER                        every fact of the user
    inferscale search USER QUERY [--k K]        top-k facts by similarity, with scores
    inferscale get USER FACT_ID
    inferscale update USER FACT_ID [--text T] [--meta KEY=VALUE ...] [--replace-metadata] [--expected-version V]
    inferscale delete USER FACT_ID [FACT_ID ...] | --all
    inferscale status                           the service's health, component by component

Every command takes --json (one JSON document on stdout: facts as their proto fields), --target (default
$INFERSCALE_TARGET, else 127.0.0.1:9000) and --token (default $INFERSCALE_TOKEN). An error prints
`error: CODE: message` on stderr and exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from . import TARGET_ENV, TOKEN_ENV

LOCAL_TARGET = "127.0.0.1:9000"
# Where no token is given: (args, user) -> a token or None. The server's CLI installs one that signs a token with
# the local development secret for a server on this machine (services/cli.py).
TokenFallback = Callable[[argparse.Namespace, str], "str | None"]


def add_commands(sub, token_fallback: TokenFallback | None = None) -> None:
    def parser(name: str, summary: str, fn, user: bool = True):
        p = sub.add_parser(name, help=summary)
        if user:
            p.add_argument("user")
        p.add_argument("--target", default=os.environ.get(TARGET_ENV) or LOCAL_TARGET,
                       help=f"gRPC address of the service (default: ${TARGET_ENV}, else {LOCAL_TARGET})")
        p.add_argument("--token", default=None, help=f"bearer token (default: ${TOKEN_ENV})")
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.add_argument("--timeout", type=float, default=300.0, help="deadline of each call, seconds")
        p.set_defaults(fn=lambda args: _run(fn, args, token_fallback))
        return p

    p = parser("add", "store facts for a user as they are", add_cmd)
    p.add_argument("facts", nargs="+")
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="metadata of every fact")

    p = parser("ask", "answer a question with the user's memory injected; streams the answer", ask_cmd)
    p.add_argument("question")
    p.add_argument("--k", type=int, default=0, help="facts to inject (0: the server's default)")
    p.add_argument("--max-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--mode", default="inject", choices=["inject", "prompt"],
                   help="inject: facts as KV; prompt: the Mem0 baseline, facts as text")
    p.add_argument("--system", default=None, help="a system message placed after the memory")

    p = parser("list", "list every fact of a user", list_cmd)
    p.add_argument("--page-size", type=int, default=0)

    p = parser("search", "the user's facts closest to a query, with scores", search_cmd)
    p.add_argument("query")
    p.add_argument("--k", type=int, default=0, help="how many (0: the server's default)")

    p = parser("get", "one fact", get_cmd)
    p.add_argument("fact_id")

    p = parser("update", "change a fact's text and/or metadata (re-encoded, version + 1)", update_cmd)
    p.add_argument("fact_id")
    p.add_argument("--text", default=None)
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--replace-metadata", action="store_true", help="replace the metadata instead of merging")
    p.add_argument("--expected-version", type=int, default=0, help="refuse (ABORTED) if the fact moved on")

    p = parser("delete", "delete facts of a user (or all of them with --all)", delete_cmd)
    p.add_argument("fact_ids", nargs="*")
    p.add_argument("--all", action="store_true", help="every fact of the user")

    parser("status", "the service's health", status_cmd, user=False)


def _run(fn, args, token_fallback: TokenFallback | None) -> int:
    import grpc  # here, not at the top: building the parser needs neither grpc nor the generated code

    from .client import MemoryClient

    user = getattr(args, "user", "")
    token = args.token or os.environ.get(TOKEN_ENV) or (token_fallback(args, user) if token_fallback and user else None)
    try:
        with MemoryClient(args.target, timeout_s=args.timeout, token=token or "") as c:
            return fn(c, args, sys.stdout)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except ValueError as e:  # a malformed argument (e.g. --meta without '=')
        print(f"error: {e}", file=sys.stderr)
        return 2


def as_dict(message) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _meta(pairs: list[str]) -> dict[str, str]:
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"--meta must be KEY=VALUE, got {bad[0]!r}")
    return dict(p.split("=", 1) for p in pairs)


def _print(out, as_json: bool, doc, lines: str) -> None:
    """One JSON document (--json) or the human-readable lines."""
    if as_json:
        out.write(json.dumps(doc, ensure_ascii=False, indent=2) + "\n")
    else:
        out.write(lines)


def _fact_line(f) -> str:
    meta = f"  {dict(f.metadata)}" if f.metadata else ""
    flag = f"  [unservable: {f.unservable_reason}]" if f.unservable_reason else ""
    return f"{f.fact_id}  v{f.version}  {f.text}{meta}{flag}"


def add_cmd(c, args, out) -> int:
    facts = c.add_facts(args.user, args.facts, metadata=_meta(args.meta))
    _print(out, args.json, [as_dict(f) for f in facts], "".join(f"{f.fact_id}  {f.text}\n" for f in facts))
    return 0


def ask_cmd(c, args, out) -> int:
    t0 = time.perf_counter()
    messages = [{"role": "system", "content": args.system}] if args.system else None
    text, final = [], None
    for chunk in c.answer(args.user, args.question, k=args.k, max_tokens=args.max_tokens,
                          temperature=args.temperature, mode=args.mode, messages=messages):
        text.append(chunk.text)
        if chunk.text and not args.json:
            out.write(chunk.text)
            out.flush()
        if chunk.final:
            final = chunk
    total_ms = (time.perf_counter() - t0) * 1000
    if args.json:
        _print(out, True, {**(as_dict(final) if final else {}), "text": "".join(text),
                           "total_ms": round(total_ms, 1)}, "")
    elif final is not None:
        out.write(f"\n\nTTFT {final.ttft_ms:.1f} ms (engine), {total_ms:.0f} ms in all; "
                  f"prompt {final.prompt_tokens} tokens, {final.prefilled_tokens} prefilled\n"
                  f"facts ({args.mode}): {', '.join(final.fact_ids) or 'none'}\n")
    return 0


def list_cmd(c, args, out) -> int:
    facts = list(c.list(args.user, page_size=args.page_size))
    _print(out, args.json, [as_dict(f) for f in facts],
           "".join(_fact_line(f) + "\n" for f in facts) + f"# {len(facts)} facts\n")
    return 0


def search_cmd(c, args, out) -> int:
    hits = c.search(args.user, args.query, k=args.k)
    _print(out, args.json, [as_dict(h) for h in hits], "".join(f"{h.score:.3f}  {_fact_line(h.fact)}\n" for h in hits))
    return 0


def get_cmd(c, args, out) -> int:
    f = c.get(args.user, args.fact_id)
    _print(out, args.json, as_dict(f), _fact_line(f) + "\n")
    return 0


def update_cmd(c, args, out) -> int:
    if args.text is None and not args.meta and not args.replace_metadata:
        raise ValueError("update needs --text and/or --meta KEY=VALUE (or --replace-metadata)")
    f = c.update(args.user, args.fact_id, text=args.text, metadata=_meta(args.meta),
                 expected_version=args.expected_version, replace_metadata=args.replace_metadata)
    _print(out, args.json, as_dict(f), _fact_line(f) + "\n")
    return 0


def delete_cmd(c, args, out) -> int:
    if args.all == bool(args.fact_ids):
        raise ValueError("delete needs FACT_IDs or --all (not both)")
    if args.all:
        n = c.delete_user(args.user)
        _print(out, args.json, {"user_id": args.user, "deleted": n}, f"deleted {n} facts of {args.user}\n")
        return 0
    for fid in args.fact_ids:
        c.delete(args.user, fid)
    _print(out, args.json, {"user_id": args.user, "deleted_fact_ids": args.fact_ids},
           "".join(f"deleted {fid}\n" for fid in args.fact_ids))
    return 0


def status_cmd(c, args, out) -> int:
    h = c.health()
    _print(out, args.json, {**as_dict(h), "target": args.target},
           f"{args.target}: {h.status}\n" + "".join(f"  {k}: {v}\n" for k, v in sorted(h.components.items())))
    return 0 if h.status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    """`inferscale` of the client-only distribution (inferscale-client): the client commands alone."""
    parser = argparse.ArgumentParser(prog="inferscale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
