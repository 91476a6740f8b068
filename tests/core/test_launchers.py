"""Topology from every launcher's environment (torchrun, Slurm, Ray Train, Kubeflow PyTorchJob), and the check at
``ts.shard`` that the declared node tier matches the hosts the ranks really run on."""
from __future__ import annotations

import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import tiershard as ts
from tiershard import topology as topo_mod
from _dist import run_ranks

LAUNCHER_VARS = ("TIERSHARD_TOPOLOGY", "TIERSHARD_HOST_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "NODE_RANK", "GROUP_RANK", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE",
                 "SLURM_TASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment with no process group; ``env(**vars)`` sets variables."""
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(topo_mod.dist, "is_initialized", lambda: False)

    def put(**values):
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))
    return put


def _with_process_group(monkeypatch, world):
    monkeypatch.setattr(topo_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(topo_mod.dist, "get_world_size", lambda group=None: world)


# ---- conventions ----------------------------------------------------------------------------------------------
def test_torchrun(env):
    env(WORLD_SIZE=8, RANK=5, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    assert ts.Topology.from_env().sizes == (4, 8)


def test_ray_train(env):
    """Ray Train sets LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, WORLD_SIZE, RANK (no GROUP_RANK) after it made the
    process group itself."""
    env(LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, NODE_RANK=1, WORLD_SIZE=6, RANK=2)
    assert ts.Topology.from_env().sizes == (2, 6)


@pytest.mark.parametrize("slurm, sizes", [
    (dict(SLURM_NTASKS=8, SLURM_NTASKS_PER_NODE=4, SLURM_NNODES=2), (4, 8)),
    (dict(SLURM_NTASKS=8, SLURM_NTASKS_PER_NODE="4(x2)", SLURM_NNODES=2), (4, 8)),
    (dict(SLURM_NTASKS=12, SLURM_TASKS_PER_NODE="4(x3)", SLURM_NNODES=3), (4, 12)),
    (dict(SLURM_NTASKS=6, SLURM_NNODES=3), (2, 6)),
    (dict(SLURM_NPROCS=4, SLURM_TASKS_PER_NODE="2(x2)", SLURM_JOB_NUM_NODES=2), (2, 4)),    # older names
])
def test_slurm_srun_directly(env, slurm, sizes):
    env(SLURM_PROCID=3, SLURM_LOCALID=1, **slurm)
    assert ts.Topology.from_env().sizes == sizes


def test_srun_then_torchrun_reads_torchrun(env):
    """One torchrun per node under srun: Slurm counts the launchers (1 per node), torchrun the ranks."""
    env(SLURM_NTASKS=2, SLURM_NTASKS_PER_NODE=1, SLURM_NNODES=2, SLURM_PROCID=1,
        WORLD_SIZE=16, LOCAL_WORLD_SIZE=8, RANK=9)
    assert ts.Topology.from_env().sizes == (8, 16)


def test_slurm_counts_of_other_processes_are_not_used(env):
    env(SLURM_NTASKS=2, SLURM_NTASKS_PER_NODE=1, SLURM_NNODES=2, WORLD_SIZE=16)
    with pytest.raises(ts.TopologyError, match=r"Slurm runs 2 tasks but the world has 16 ranks"):
        ts.Topology.from_env()


def test_uneven_slurm_nodes(env):
    env(SLURM_NTASKS=6, SLURM_TASKS_PER_NODE="4,2", SLURM_NNODES=2)
    with pytest.raises(ts.TopologyError, match=r"SLURM_TASKS_PER_NODE='4,2'.*same number of ranks"):
        ts.Topology.from_env()
    env(SLURM_NTASKS=7, SLURM_NNODES=2, SLURM_TASKS_PER_NODE="")
    with pytest.raises(ts.TopologyError, match=r"SLURM_NTASKS=7 ranks on SLURM_NNODES=2 nodes"):
        ts.Topology.from_env()


def test_nothing_says_ranks_per_node(env):
    env(WORLD_SIZE=4, RANK=0)
    with pytest.raises(ts.TopologyError) as err:
        ts.Topology.from_env()
    for fragment in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NNODES",
                     "Topology((ranks_per_node, 4))", "TIERSHARD_TOPOLOGY"):
        assert fragment in str(err.value)


def test_single_process_needs_nothing(env):
    assert ts.Topology.from_env().sizes == (1, 1)


def test_pytorchjob_world_size_counts_pods(env, monkeypatch):
    """Kubeflow's older PyTorchJob sets WORLD_SIZE to the number of pods; the process group knows the ranks."""
    env(WORLD_SIZE=2, RANK=1, LOCAL_WORLD_SIZE=4)
    _with_process_group(monkeypatch, 8)
    with pytest.warns(UserWarning, match=r"WORLD_SIZE=2 but the process group has 8 ranks"):
        assert ts.Topology.from_env().sizes == (4, 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ts.TopologyError, match=r"(?s)WORLD_SIZE=2 .*process group has 8.*LOCAL_WORLD_SIZE"):
            ts.Topology.from_env()


def test_process_group_without_env(env, monkeypatch):
    _with_process_group(monkeypatch, 4)
    env(LOCAL_WORLD_SIZE=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ts.Topology.from_env().sizes == (2, 4)


@pytest.mark.parametrize("values, fragment", [
    (dict(WORLD_SIZE=8, LOCAL_WORLD_SIZE="four"), "LOCAL_WORLD_SIZE='four' is not a whole number"),
    (dict(WORLD_SIZE="x", LOCAL_WORLD_SIZE=2), "WORLD_SIZE='x' is not a whole number"),
    (dict(WORLD_SIZE=8, LOCAL_WORLD_SIZE=3), "LOCAL_WORLD_SIZE=3 does not divide the world of 8 ranks"),
    (dict(WORLD_SIZE=8, LOCAL_WORLD_SIZE=0), "LOCAL_WORLD_SIZE=0 does not divide the world of 8 ranks"),
    (dict(SLURM_NTASKS=8, SLURM_NTASKS_PER_NODE="4(x"), "SLURM_NTASKS_PER_NODE='4(x' is not"),
    (dict(WORLD_SIZE=0, LOCAL_WORLD_SIZE=1), "WORLD_SIZE=0 is not a world size"),
    (dict(LOCAL_WORLD_SIZE=4), "LOCAL_WORLD_SIZE is set but neither WORLD_SIZE nor a process group"),
])
def test_bad_values_name_the_variable(env, values, fragment):
    env(**values)
    with pytest.raises(ts.TopologyError, match=fragment.replace("(", r"\(")):
        ts.Topology.from_env()


def test_from_env_keeps_names_timeout_and_tiershard_topology(env):
    env(WORLD_SIZE=8, LOCAL_WORLD_SIZE=4)
    topo = ts.Topology.from_env(names=("host", "all"), timeout=7)
    assert (topo.sizes, topo.names, topo.timeout) == ((4, 8), ("host", "all"), 7.0)
    env(TIERSHARD_TOPOLOGY="2,4,8")
    assert ts.Topology.from_env().sizes == (2, 4, 8)


# ---- declared tiers against real hosts --------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, names, hosts", [
    ((2, 4), None, "AAAA"),                  # one host holding two node groups: emulated nodes on one machine
    ((2, 4), None, "AABB"),
    ((1, 4), None, "ABCD"),
    ((4,), None, "ABCD"),                    # a single tier assumes nothing about nodes
    ((2, 4, 8), None, "AAAABBBB"),           # node = the tier below world
    ((2, 4, 8, 16), ("gcd", "node", "rack", "world"), "AAAABBBBCCCCDDDD"),    # the tier named node
])
def test_hosts_that_match(sizes, names, hosts):
    ts.Topology(sizes, names).check_hosts(list(hosts))


@pytest.mark.parametrize("sizes, names, hosts, fragment", [
    ((2, 4), None, "ABAB", "node group of ranks 0-1 spans 2 hosts: rank 0 on 'A', rank 1 on 'B'"),
    ((4, 8), None, "AAABBBBB", "node group of ranks 0-3 spans 2 hosts: ranks 0-2 on 'A', rank 3 on 'B'"),
    ((4, 8), None, "AAABBBBB", "the hosts run different numbers of ranks (3, 5)"),
    ((2, 4), None, "ABAB", "not placed node by node"),
    ((2, 4, 8), None, "AABBCCDD", "node group of ranks 0-3 spans 2 hosts"),
    ((2, 4, 8, 16), ("gcd", "node", "rack", "world"), "AABBCCDDEEFFGGHH", "node group of ranks 0-3"),
])
def test_hosts_that_do_not_match(sizes, names, hosts, fragment):
    with pytest.raises(ts.TopologyError) as err:
        ts.Topology(sizes, names).check_hosts(list(hosts))
    assert fragment in str(err.value)
    assert "Topology((ranks_per_node, world))" in str(err.value)


def test_host_id_override(monkeypatch):
    monkeypatch.setenv("TIERSHARD_HOST_ID", "rack3-node7")
    assert topo_mod.host_identity() == "rack3-node7"


def test_suggests_the_ranks_per_host():
    with pytest.raises(ts.TopologyError, match=r"ranks run 4 per host.*Topology\(\(4, 8\)\)"):
        ts.Topology((8, 8)).check_hosts(list("AAAABBBB"))


def test_network_namespaces_look_like_hosts():
    """The emulated cluster puts each node in a network namespace of one machine: the identity tells them apart."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    code = "from tiershard.topology import host_identity; print(host_identity())"
    there = subprocess.run(["unshare", "-rn", sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
    if there.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {there.stderr.strip()[-200:]}")
    here = topo_mod.host_identity()
    assert here != there.stdout.strip()
    assert here.split("/net:")[0] == there.stdout.split("/net:")[0]       # the same hostname


def _at_shard(rank, world):
    """Every multi-rank check at once: one host passes, a faked split of node groups and disagreeing ranks fail."""
    out = {"host": topo_mod.host_identity()}
    topo = ts.Topology((2, world))
    topo.init_process_groups()
    out["one_host_ok"] = topo.mesh.mesh.tolist()
    real = topo_mod.host_identity
    topo_mod.host_identity = lambda: "hostA" if rank % 2 == 0 else "hostB"    # ranks 0, 2 on A; 1, 3 on B
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            ts.shard(model, "GGG", ts.Topology((2, world)))
            out["split"] = None
        except ts.TopologyError as err:
            out["split"] = str(err)
        out["untouched"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        topo_mod.host_identity = real
    try:
        ts.Topology((1, world) if rank == 3 else (2, world)).init_process_groups()
        out["disagree"] = None
    except ts.TopologyError as err:
        out["disagree"] = str(err)
    dist.barrier()
    return out


def test_declared_nodes_are_checked_against_hosts_at_shard():
    results = run_ranks(_at_shard, 4)
    assert len({r["host"] for r in results}) == 1
    for r in results:
        assert r["one_host_ok"] == [[0, 2], [1, 3]]
        assert "node group of ranks 0-1 spans 2 hosts: rank 0 on 'hostA', rank 1 on 'hostB'" in r["split"], r
        assert "node group of ranks 2-3 spans 2 hosts" in r["split"]
        assert r["untouched"]
        assert "rank 0 declares Topology((2, 4)" in r["disagree"] and "rank 3 declares Topology((1, 4)" in \
            r["disagree"], r
