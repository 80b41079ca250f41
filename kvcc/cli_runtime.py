"""``kvcc serve directory | node`` and ``kvcc cluster up``: the reference implementation's processes.

Kept apart from ``kvcc.cli`` so that the runtime's imports stay out of the spec commands.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("serve", help="run one process of the reference implementation",
                       description="Run the directory or a cache node until SIGINT/SIGTERM.")
    ssub = p.add_subparsers(dest="role", metavar="ROLE", required=True)

    d = ssub.add_parser("directory", help="the directory (metadata) service")
    _common(d)
    d.add_argument("--state", required=True, type=Path, help="state directory (the durable log)")
    d.add_argument("--backend", choices=("sqlite", "etcd"), default="sqlite", help="durable log (default sqlite)")
    d.add_argument("--etcd-endpoints", metavar="URL[,URL...]", help="etcd client URLs (backend etcd)")
    d.add_argument("--etcd-prefix", default="kvcc", help="key prefix in etcd (default kvcc)")
    d.add_argument("--shards", type=int, default=1, metavar="N",
                   help="the directory is sharded N ways by chain root (docs/sharding.md; default 1). Without "
                        "--shard, serve every shard: one child process per shard, shard I with state "
                        "STATE/shard-I, etcd prefix PREFIX-sI, port PORT+I (any free one if PORT is 0), "
                        "events FILE-I, all stopped together; the ready file lists each shard's port")
    d.add_argument("--shard", type=int, default=None, metavar="I",
                   help="serve only shard I of N, with its own --state or --etcd-prefix")
    d.set_defaults(func=cmd_serve_directory)

    n = ssub.add_parser("node", help="a cache node with storage tiers")
    _common(n)
    n.add_argument("--id", required=True, dest="node_id", help="node id (locations are ID/TIER)")
    n.add_argument("--directory", required=True, action="append", metavar="HOST:PORT",
                   help="the directory's address; for a directory sharded N ways, give it N times, once per "
                        "shard in shard order (shard 0 first): the node registers with every shard")
    n.add_argument("--state", required=True, type=Path, help="state directory (incarnation, NVMe slabs)")
    n.add_argument("--tier", action="append", default=[], metavar="KIND=SIZE",
                   help="a tier, fastest first: gpu=1GiB, dram=256MiB, nvme=4GiB (repeatable)")
    n.add_argument("--block-bytes", type=int, default=1 << 20, help="largest block (default 1 MiB)")
    n.add_argument("--pool", metavar="DIR", help="mount the shared pool at DIR (location 'pool')")
    n.set_defaults(func=cmd_serve_node)

    p = sub.add_parser("cluster", help="a local cluster on loopback", description="A local cluster on loopback.")
    csub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    u = csub.add_parser("up", help="start a directory (or its shards) and N nodes, run the demo workload, stop",
                        description="Start a directory and N cache nodes as processes on loopback, run the demo "
                                    "workload (writes, leased reads from peers, a prefix invalidation, evictions, "
                                    "a fenced stale writer), print what happened, and shut down cleanly.")
    u.add_argument("--nodes", type=int, default=3)
    u.add_argument("--shards", type=int, default=1, metavar="N",
                   help="shard the directory N ways, one process per shard, every node registered with every "
                        "shard (docs/sharding.md; default 1)")
    u.add_argument("--workdir", type=Path, help="where state, logs and event traces go (default: a temp dir)")
    u.add_argument("--backend", choices=("sqlite", "etcd"), default="sqlite")
    u.add_argument("--etcd-endpoints", metavar="URL[,URL...]", help="an etcd to use (default with --backend "
                   "etcd: start one on loopback)")
    u.add_argument("--serve", action="store_true", help="after the demo, keep serving until Ctrl-C")
    u.add_argument("--metrics", action="store_true", help="every process serves Prometheus metrics on a free "
                   "loopback port (printed, and in --json as metrics_urls)")
    u.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    u.set_defaults(func=cmd_cluster_up)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="the deployment file (JSON: tenants, lease term, skew)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="TCP port (default: any free one)")
    p.add_argument("--events", metavar="FILE", help="append protocol events here (NDJSON)")
    p.add_argument("--ready-file", metavar="FILE", help="write {port, pid[, metrics_port]} here once serving")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free port, "
                        "reported in the ready file; default: no metrics)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--verbose", action="store_true")


def cmd_serve_directory(args: argparse.Namespace) -> int:
    from kvcc.reference import serve

    serve.configure_logging(args.verbose)
    layout = _state_layout_problem(args)
    if layout is not None:
        print(f"kvcc serve directory: {layout}", file=sys.stderr)
        return 2
    if args.shard is None and args.shards > 1:
        return _serve_every_shard(args)
    try:
        config = serve.ClusterConfig.load(args.config)
        return serve.run(serve.serve_directory(
            config, state=args.state, host=args.host, port=args.port, backend=args.backend,
            etcd_endpoints=args.etcd_endpoints, etcd_prefix=args.etcd_prefix, events=args.events,
            ready_file=args.ready_file, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
            shard=args.shard or 0, shards=args.shards))  # fmt: skip
    except serve.ConfigError as e:
        print(f"kvcc serve directory: {e}", file=sys.stderr)
        return 2


SHARD_START_TIMEOUT_S = 60.0


def _shard_file(path: str, i: int) -> str:
    """``events.ndjson`` -> ``events-<i>.ndjson``: shard ``i``'s file beside the one named."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{i}{p.suffix}"))


def _state_layout_problem(args: argparse.Namespace) -> str | None:
    """Why ``--state`` holds another layout's log than the one asked for, or None. Every shard's
    log, served with ``--shards N`` alone, lives in ``STATE/shard-I``; the one directory's, or one
    shard's with ``--shard I``, in ``STATE`` itself. Serving beside the other layout's log would
    start an empty directory under nodes that hold the old one's fences and epochs (a log of
    another shard or shard count is refused by ``serve_directory`` itself)."""
    if args.backend != "sqlite" or not args.state.is_dir():
        return None
    every_shard = args.shard is None and args.shards > 1
    if every_shard and (args.state / "directory.db").exists():
        return (f"{args.state} holds a directory's log (directory.db): serve it with --shard I --shards N (a log "
                f"records its shard), or give every shard's processes a new --state")  # fmt: skip
    shard_dirs = sorted(p.name for p in args.state.glob("shard-*") if p.is_dir())
    if not every_shard and shard_dirs:
        return (f"{args.state} holds every shard's logs ({', '.join(shard_dirs)}): serve them with --shards N and "
                f"no --shard")  # fmt: skip
    return None


def _exit_status(returncode: int | None) -> int:
    """A shard's exit status as this process's: its own if it exited non-zero, 1 otherwise (killed,
    or ended while it should have served)."""
    return returncode if returncode is not None and returncode > 0 else 1


def _serve_every_shard(args: argparse.Namespace) -> int:
    """``kvcc serve directory --shards N`` without ``--shard``: each shard a child process of its
    own (a shard is a whole directory: its own log, port, lease ids and event log), started
    side by side, this process writing the ready file once every shard serves (``port``: shard
    0's; ``shards``: each one's ``port``, ``pid``, ...) and stopping them all on SIGINT or SIGTERM.
    A shard that exits on its own stops the others, and the exit status is its own (2: a log
    of another shard or shard count, ``serve_directory``)."""
    import json
    import os
    import shutil
    import signal

    from kvcc.reference import procs, serve

    n = args.shards
    if args.port and not 0 < args.port + n - 1 <= 65535:
        print(f"kvcc serve directory: --port {args.port} leaves no room for {n} shards' ports", file=sys.stderr)
        return 2
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    run_dir = Path(tempfile.mkdtemp(prefix="kvcc-shards-"))
    children: list[Any] = []
    rc = 0
    try:
        for i in range(n):
            argv = [sys.executable, "-m", "kvcc", "serve", "directory", "--config", str(args.config),
                    "--state", str(args.state / f"shard-{i}"), "--backend", args.backend,
                    "--etcd-prefix", f"{args.etcd_prefix}-s{i}", "--shard", str(i), "--shards", str(n),
                    "--host", args.host, "--port", str(args.port + i if args.port else 0),
                    "--ready-file", str(run_dir / f"shard-{i}.json"), "--metrics-host", args.metrics_host]  # fmt: skip
            if args.etcd_endpoints:
                argv += ["--etcd-endpoints", args.etcd_endpoints]
            if args.events:
                argv += ["--events", _shard_file(args.events, i)]
            if args.metrics_port is not None:
                argv += ["--metrics-port", str(args.metrics_port + i if args.metrics_port else 0)]
            if args.verbose:
                argv.append("--verbose")
            children.append(procs.spawn(argv, sys.stderr.buffer, env=dict(os.environ), die_with_parent=True))
        infos: list[dict[str, Any]] = []
        deadline = time.monotonic() + SHARD_START_TIMEOUT_S
        for i, child in enumerate(children):
            ready = run_dir / f"shard-{i}.json"
            while not ready.exists():
                if child.poll() is not None or stop or time.monotonic() > deadline:
                    why = (f"exited {child.returncode}" if child.poll() is not None
                           else "stopped" if stop else f"not serving within {SHARD_START_TIMEOUT_S:.0f} s")  # fmt: skip
                    print(f"kvcc serve directory: shard {i} of {n} {why}", file=sys.stderr)
                    return 0 if stop and child.poll() is None else _exit_status(child.returncode)
                time.sleep(0.05)
            infos.append({"shard": i, **json.loads(ready.read_text())})
        serve.write_ready(args.ready_file, port=infos[0]["port"], shards=infos)
        print(f"kvcc serve directory: {n} shards on " + ", ".join(f"{args.host}:{x['port']}" for x in infos),
              file=sys.stderr, flush=True)  # fmt: skip
        while not stop:
            dead = next((i for i, c in enumerate(children) if c.poll() is not None), None)
            if dead is not None:
                print(f"kvcc serve directory: shard {dead} of {n} exited {children[dead].returncode}; stopping "
                      "the others", file=sys.stderr)  # fmt: skip
                rc = _exit_status(children[dead].returncode)
                break
            time.sleep(0.2)
        return rc
    finally:
        for child in children:
            procs.stop_process(child, grace_s=10.0)
        shutil.rmtree(run_dir, ignore_errors=True)


def cmd_serve_node(args: argparse.Namespace) -> int:
    from kvcc.reference import serve

    serve.configure_logging(args.verbose)
    try:
        config = serve.ClusterConfig.load(args.config)
        tiers = [serve.parse_tier(t) for t in args.tier]
        return serve.run(serve.serve_node(
            config, node_id=args.node_id, directory=args.directory, state=args.state, host=args.host,
            port=args.port, tiers=tiers, block_bytes=args.block_bytes, pool=args.pool, events=args.events,
            ready_file=args.ready_file, metrics_host=args.metrics_host, metrics_port=args.metrics_port))  # fmt: skip
    except serve.ConfigError as e:
        print(f"kvcc serve node: {e}", file=sys.stderr)
        return 2


def cmd_cluster_up(args: argparse.Namespace) -> int:
    from kvcc.reference.cluster import ClusterError, LocalCluster
    from kvcc.reference.demo import DEMO_NAMESPACE, run_demo

    console = Console(stderr=args.json)
    if args.nodes < 1:
        console.print("kvcc cluster up: --nodes must be at least 1")
        return 2
    if args.shards < 1:
        console.print("kvcc cluster up: --shards must be at least 1")
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvcc-cluster-"))
    etcd = None
    endpoints = args.etcd_endpoints
    started = time.monotonic()
    try:
        if args.backend == "etcd" and not endpoints:
            from kvcc.reference.etcd_harness import EtcdCluster

            etcd = EtcdCluster(1, workdir / "etcd")
            etcd.start()
            endpoints = ",".join(etcd.endpoints)
        cluster = LocalCluster(workdir, nodes=args.nodes, namespaces=[DEMO_NAMESPACE], backend=args.backend,
                               etcd_endpoints=endpoints, metrics=args.metrics, shards=args.shards)  # fmt: skip
        what = "a directory" if args.shards == 1 else f"{args.shards} directory shards"
        with console.status(f"starting {what} and {args.nodes} nodes ..."):
            cluster.start()
        try:
            pids = {name: p.popen.pid for name, p in cluster.procs.items() if p.popen}
            if args.shards == 1:
                where = f"directory on 127.0.0.1:{cluster.directory_address[1]}"
            else:
                where = "directory shards " + ", ".join(f"{i} on {host}:{port}" for i, (host, port)
                                                        in enumerate(cluster.directory_addresses))  # fmt: skip
            console.print(f"[bold]kvcc cluster[/]: {where} "
                          f"({args.backend}), nodes {', '.join(cluster.node_ids)}; pids {pids}")
            metrics_urls = {name: cluster.metrics_url(name) for name in cluster.procs} if args.metrics else {}
            for name, url in metrics_urls.items():
                console.print(f"metrics of {name}: {url}")
            rows = run_demo(cluster)
            table = Table(title="demo workload", show_lines=True)
            for col in ("step", "what", "outcome"):
                table.add_column(col)
            for row in rows:
                table.add_row(*row)
            console.print(table)
            events = cluster.events()
            counts: dict[str, int] = {}
            for e in events:
                counts[e["event"]] = counts.get(e["event"], 0) + 1
            console.print(f"{len(events)} protocol events in {workdir / 'events'}: "
                          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
            if args.serve:
                console.print("serving; Ctrl-C to stop")
                try:
                    while all(cluster.alive(n) for n in cluster.procs):
                        time.sleep(0.5)
                except KeyboardInterrupt:
                    pass
        finally:
            with console.status("stopping ..."):
                cluster.stop()
        leftovers = [n for n in cluster.procs if cluster.alive(n)]
        console.print(f"stopped cleanly in {time.monotonic() - started:.1f} s" if not leftovers
                      else f"[red]processes left running: {leftovers}[/]")  # fmt: skip
        if args.json:
            print(json.dumps({"ok": not leftovers, "workdir": str(workdir), "steps": [list(r) for r in rows],
                              "events": counts, "metrics_urls": metrics_urls}))  # fmt: skip
        return 0 if not leftovers else 1
    except ClusterError as e:
        console.print(f"[red]kvcc cluster up: {e}[/]")
        return 1
    finally:
        if etcd is not None:
            etcd.stop()
