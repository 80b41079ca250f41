"""etcd fixtures: a real etcd (Debian's etcd-server) on loopback, started per need.

A missing ``etcd`` binary fails the tests that use it (scripts/system-deps.sh installs etcd-server).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest


def _etcd_children() -> list[int]:
    """PIDs of etcd processes whose parent is this (pytest / xdist worker) process."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            comm, ppid = stat[stat.index("(") + 1 : stat.rindex(")")], int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and comm.startswith("etcd"):
            out.append(int(d.name))
    return out


@pytest.fixture(scope="session")
def etcd_leak_check():
    """Session end: no etcd process started by this process is still running."""
    from kvcc.reference import etcd_harness

    try:
        etcd_harness.etcd_binary()
    except etcd_harness.EtcdNotInstalled as e:
        pytest.fail(f"etcd is required (scripts/system-deps.sh installs etcd-server): {e}")

    yield
    leaked = sorted(set(etcd_harness.live_pids()) | set(_etcd_children()))
    assert not leaked, f"etcd processes left running: {leaked}"


@pytest.fixture(scope="session")
def etcd1(etcd_leak_check):
    """One single-member cluster for the session (tests use their own key prefix)."""
    from kvcc.reference.etcd_harness import EtcdCluster

    with EtcdCluster(members=1) as cluster:
        yield cluster


@pytest.fixture
def etcd3(etcd_leak_check, request):
    """A fresh three-member cluster per test (the failover tests kill and pause members).
    When the test failed, the members' logs go to its captured output."""
    from kvcc.reference.etcd_harness import EtcdCluster

    failed_before = request.session.testsfailed
    with EtcdCluster(members=3) as cluster:
        yield cluster
        if request.session.testsfailed > failed_before:
            print(cluster.logs(lines=60))


@pytest.fixture
def etcd_kv(etcd1):
    """A client on the session cluster, and a key prefix unique to the test."""
    from kvcc.reference.etcd_client import EtcdKV

    with EtcdKV(etcd1.endpoints, request_timeout_s=5.0, failover_timeout_s=10.0) as kv:
        yield kv, f"t/{uuid.uuid4().hex[:8]}/"


# The directory's store backends (sqlite, etcd) as one parameterised fixture; see tests/backends.py.
from backends import directory_store_factory  # noqa: E402, F401


# ---- cost markers -----------------------------------------------------------------------------
# Every test module has one cost class, so that a developer can run a fast loop
# (`bash scripts/test.sh -m unit`, seconds) while the README's command still runs everything:
#   unit         in-process, no model search: milliseconds to seconds per test;
#   model        the model checker, the z3 proofs or the trace validator over searched traces;
#   suite        the conformance suite run in-process against adapters (many workloads per test);
#   integration  real processes on loopback: directories, cache nodes, etcd members, Mooncake.
# A new test module must be added here (test_every_module_has_a_cost_class fails otherwise).
COST_CLASSES = {
    "unit": {"test_rules", "test_client", "test_holder", "test_keys", "test_names", "test_wire", "test_bench_tiers",
             "test_bench_directory", "test_packaging", "test_docs", "test_render", "test_layers", "test_routing",
             "test_bench_suite", "test_bench_sglang", "test_sglang_server", "test_directory_shards", "test_vllm_cuda_layout"},
    "model": {"test_spec", "test_proofs", "test_validate", "test_accel", "test_validate_shards", "test_cli", "test_directory_core"},
    "suite": {"test_conformance", "test_example_adapter", "test_mutation", "test_lmcache", "test_runner_close_run"},
    "integration": {"test_cluster_cli", "test_cluster_stateful", "test_cluster_processes", "test_deletion",
                    "test_faults", "test_etcd", "test_mooncake", "test_directory_server", "test_directory_store",
                    "test_transport", "test_tiers", "test_tiers_recovery", "test_tiers_stateful", "test_metrics",
                    "test_procs", "test_vllm", "test_vllm_connector", "test_vllm_connector_contract", "test_vllm_deployment", "test_routing_smg", "test_fuzz", "test_soak",
                    "test_transport_limits", "test_tls", "test_sglang", "test_sglang_conformance", "test_identities",
                    "test_vllm_conformance", "test_chains", "test_crash_points", "test_routing_calibrate",
                    "test_routing_live", "test_routing_vllm", "test_bench_suite_reference",
                    "test_directory_shards_serve", "test_tiers_pool_crashes", "test_sharded_client", "test_node_shards"},
}


def cost_class(module_name: str) -> str | None:
    for cost, modules in COST_CLASSES.items():
        if module_name in modules:
            return cost
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        cost = cost_class(item.module.__name__.rpartition(".")[2])
        if cost is not None:
            item.add_marker(getattr(pytest.mark, cost))
