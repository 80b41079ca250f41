"""``kvcc admin nodes | invalidate``: what an operator does to a running deployment, under the
operator's own credential (the deployment file's ``operators`` section, ``operator:<name>`` on the
wire).

An operator credential invalidates and looks up in every namespace and lists the nodes; the
directory refuses it anything else (``kvcc.reference.wire.tenants``). So this command can void a
model's blocks across every tenant that cached them -- a weights update, a tokenizer change, a
poisoned prefix -- without holding any tenant's token, and can do nothing else.

Bad input (an operator the file does not name, a digest that is not 64 hex digits, a scope that
needs a key and has none) is refused before anything is sent: exit 2, one line on stderr. A
directory that cannot be reached, or that refuses: exit 3. ``invalidate --wait S`` exits 1 if the
invalidation had not completed within S seconds (it goes on: the directory completes it once every
lease on the voided blocks is acknowledged or has run out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

EXIT_NOT_COMPLETED, EXIT_BAD_INPUT, EXIT_UNREACHABLE = 1, 2, 3


class _BadInput(Exception):
    pass


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("admin", help="an operator's actions on a running deployment",
                       description="An operator's actions on a running deployment, under the operator's own "
                                   "credential (the deployment file's operators section).")  # fmt: skip
    asub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    n = asub.add_parser("nodes", help="the cache nodes the directory knows, with their addresses")
    _common(n)
    n.set_defaults(func=cmd_nodes)
    i = asub.add_parser("invalidate", help="void blocks in any namespace (key, prefix or whole namespace)")
    _common(i)
    i.add_argument("--namespace", required=True, metavar="HEX64", help="the namespace's digest")
    i.add_argument("--scope", choices=("key", "prefix", "namespace"), required=True)
    i.add_argument("--key", metavar="HEX64", help="the block key (scopes key and prefix)")
    i.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the invalidation to complete (default: do not wait)")
    i.set_defaults(func=cmd_invalidate)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="the deployment file")
    p.add_argument("--operator", required=True, metavar="NAME", help="an operator the file's operators section names")
    p.add_argument("--directory", required=True, metavar="HOST:PORT")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def _digest(text: str | None, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text or "")
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise _BadInput(f"{what} is 64 hex digits, got {str(text)[:80]!r}")
    return raw


def _client(args: argparse.Namespace) -> Any:
    """The operator's client (not started), or ``_BadInput``."""
    from kvcc.reference import serve
    from kvcc.reference.client import KvccClient
    from kvcc.reference.wire import operator_credential

    try:
        config = serve.ClusterConfig.load(args.config)
    except serve.ConfigError as e:
        raise _BadInput(str(e)) from None
    credential = operator_credential(args.operator)
    token = config.tenants.token(credential)
    if token is None or config.tenants.operator_of(credential) is None:
        raise _BadInput(f"the deployment file names no operator {args.operator[:80]!r} (its operators section)")
    host, _, port = args.directory.rpartition(":")
    if not host or not port.isdigit():
        raise _BadInput(f"--directory takes HOST:PORT, got {args.directory[:80]!r}")
    return KvccClient((host, int(port)), credential, token, client_id=f"operator.{args.operator}",
                      skew_ms=config.skew_ms, tls=config.tls)  # fmt: skip


def _run(args: argparse.Namespace, act: Any) -> int:
    from kvcc.reference.errors import KvccError

    try:
        client = _client(args)
    except _BadInput as e:
        print(f"kvcc admin {args.action}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    async def go() -> tuple[int, dict]:
        async with client:
            return await act(client)

    try:
        code, out = asyncio.run(go())
    except (KvccError, OSError, TimeoutError) as e:
        print(f"kvcc admin {args.action}: the directory at {args.directory} failed: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(json.dumps(out, sort_keys=True) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return code


def cmd_nodes(args: argparse.Namespace) -> int:
    async def act(client: Any) -> tuple[int, dict]:
        return 0, {"nodes": await client.refresh_nodes()}

    return _run(args, act)


def cmd_invalidate(args: argparse.Namespace) -> int:
    try:
        namespace = _digest(args.namespace, "--namespace")
        key = None if args.scope == "namespace" and args.key is None else _digest(args.key, "--key")
        if args.scope == "namespace" and key is not None:
            raise _BadInput("--scope namespace takes no --key")
        if args.wait < 0:
            raise _BadInput("--wait is >= 0")
    except _BadInput as e:
        print(f"kvcc admin invalidate: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    async def act(client: Any) -> tuple[int, dict]:
        from kvcc.spec.keys import BlockKey

        ticket = await client.invalidate(namespace, args.scope, None if key is None else BlockKey(key))
        done = await client.wait(ticket, args.wait) if args.wait > 0 else None
        out = {"ticket": int(ticket), "keys": ticket.keys, "completed": done}
        return (EXIT_NOT_COMPLETED if done is False else 0), out

    return _run(args, act)
