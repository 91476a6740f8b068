"""The emulated cluster: rate parsing, command construction, names and errors without root; and, where this process
is root and may create network namespaces, one real cluster: up, a 4-rank gloo all_reduce whose NIC bytes match the
ring formula, intra-node traffic off the NIC, failures and interrupts cleaned up, down."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tiershard.cluster.emulated as tc
import tiershard.cluster.netns as host      # the host side: patch its run_ip / STATE_DIR to fake ip and tc
from tiershard.cluster.emulated import (ClusterError, EmulatedCluster, LaunchError, cluster_namespaces,
                                        format_rate, parse_rate, rank_env, ring_allreduce_nic_bytes, shape_commands,
                                        up_commands)

MiB = 2**20


# ---------------------------------------------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize("text,bits", [
    ("250mbit", 250_000_000), ("1gbit", 10**9), ("1Gbit", 10**9), ("1.5gbit", 1_500_000_000),
    ("500kbit", 500_000), ("2mibit", 2 * 2**20), ("100000", 100_000), (" 10 mbit ", 10**7), ("1tbit", 10**12),
    (250_000_000, 250_000_000), ("none", None), ("unlimited", None), ("NONE", None), (None, None), (0, None),
])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text,words", [
    ("250mbps", "ambiguous"), ("30MB/s", "ambiguous"), ("1Gb/s", "ambiguous"), ("fast", "not a tc rate"),
    ("-5mbit", "not a tc rate"),
    ("0mbit", "zero"), ("1.2.3gbit", "not a tc rate"), (-3, "positive"), ("4bit", "below 8bit"), (True, "not a rate"),
])
def test_parse_rate_errors_name_the_fix(text, words):
    with pytest.raises(ClusterError) as err:
        parse_rate(text)
    assert words in str(err.value) and ("250mbit" in str(err.value) or "positive" in str(err.value))


@pytest.mark.parametrize("text", ["250mbit", "1gbit", "1500mbit", "12345bit", "none", "64kbit"])
def test_format_rate_round_trips(text):
    assert format_rate(parse_rate(text)) == text


def test_tbf_burst_covers_ten_ms_of_fast_rates():
    assert tc.tbf_burst(100_000_000) == 256 * 1024
    assert tc.tbf_burst(250_000_000) == 312_500
    assert tc.tbf_burst(100 * 10**9) == 100 * 10**9 // 8 // 100
    assert tc.tbf_args(10**9)[:3] == ["tbf", "rate", "1000000000bit"]


def test_up_commands_cap_uplinks_and_switch_ports_under_the_prefix():
    cmds = up_commands("main", 3, 250_000_000)
    made = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert made == ["ts-main-sw", "ts-main-n0", "ts-main-n1", "ts-main-n2"]
    for cmd in cmds:                                  # every command names one of this cluster's namespaces
        assert any(ns in cmd for ns in made), cmd
    caps = {(c[2], c[6]) for c in cmds if c[0] == "tc"}
    assert caps == {(f"ts-main-n{i}", "eth0") for i in range(3)} | {("ts-main-sw", f"p{i}") for i in range(3)}
    assert all(c[4] == "replace" and c[8:10] == ["tbf", "rate"] for c in cmds if c[0] == "tc")
    addrs = [c[5] for c in cmds if c[3:5] == ["addr", "add"]]
    assert addrs == ["10.77.0.1/24", "10.77.0.2/24", "10.77.0.3/24"]
    # veth ends are created inside the namespaces: nothing appears in the root namespace
    veths = [c for c in cmds if "veth" in c]
    assert all(c[4] == "netns" and c[-2] == "netns" for c in veths) and len(veths) == 3
    assert not any(c[0] == "tc" for c in up_commands("main", 2, None))


def test_shape_commands_remove_or_replace_the_cap():
    assert [c[4] for c in shape_commands("x", 2, None)] == ["del"] * 4
    assert [c[4] for c in shape_commands("x", 2, 10**9)] == ["replace"] * 4


def test_namespaces_are_grouped_by_cluster_and_foreign_ones_ignored():
    names = ["ts-main-n1", "ts-main-sw", "ts-main-n0", "ts-main-n10", "ts-t42-n0", "other", "ts-main", "tsx-a-n0",
             "ts-Main-n0", "ts-main-n0x", "myts-main-n0"]
    assert cluster_namespaces(names) == {"main": ["ts-main-n0", "ts-main-n1", "ts-main-n10", "ts-main-sw"],
                                         "t42": ["ts-t42-n0"]}


@pytest.mark.parametrize("name", ["", "Main", "a-b", "x" * 17, "_a", "a b"])
def test_bad_cluster_names(name):
    with pytest.raises(ClusterError, match="cluster name"):
        tc.check_name(name)


def test_rank_env_places_ranks_node_by_node():
    env = rank_env(3, nodes=2, ranks_per_node=2, port=29511)
    assert env["MASTER_ADDR"] == "10.77.0.1" and env["MASTER_PORT"] == "29511"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert (env["NODE_RANK"], env["GROUP_RANK"], env["GLOO_SOCKET_IFNAME"]) == ("1", "1", "eth0")


def test_ring_allreduce_formula():
    assert ring_allreduce_nic_bytes(64 * MiB, 2, 2) == 96 * MiB          # 2(n-1)/n of the buffer, one edge per node
    assert ring_allreduce_nic_bytes(64 * MiB, 2, 1) == 64 * MiB
    assert ring_allreduce_nic_bytes(64 * MiB, 1, 4) == 0


def test_constructor_rejects_bad_shapes():
    with pytest.raises(ClusterError, match="nodes"):
        EmulatedCluster(0, 2)
    with pytest.raises(ClusterError, match="ranks_per_node"):
        EmulatedCluster(2, 0)
    with pytest.raises(ClusterError, match="tc rate"):
        EmulatedCluster(2, 2, "fast")


def test_node_command_wraps_in_the_node_namespace():
    c = EmulatedCluster(2, 2, "1gbit", name="abc")
    c._tools = {"ip": "/sbin/ip", "tc": "/sbin/tc"}
    assert c.node_command(1, ["python", "x.py"]) == ["/sbin/ip", "netns", "exec", "ts-abc-n1", "python", "x.py"]
    assert c.node_address(1) == "10.77.0.2"
    with pytest.raises(ClusterError, match="not in this cluster"):
        c.node_address(2)


# ---------------------------------------------------------------------------------------------------------------
# Errors without root or iproute2 (simulated)


def test_not_root_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(host.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        EmulatedCluster(2, 2, "250mbit").up()
    from tiershard.cli import main
    assert main(["cluster", "up", "--nodes", "2", "--inter-bw", "250mbit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs root" in err and err.startswith("tiershard cluster: error:")


def test_missing_iproute2_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(host.os, "geteuid", lambda: 0)
    monkeypatch.setattr(host.shutil, "which", lambda tool, path=None: "/usr/sbin/ip" if tool == "ip" else None)
    with pytest.raises(ClusterError, match="tc not found: install iproute2"):
        tc.require_root_and_tools()
    from tiershard.cli import main
    assert main(["cluster", "status"]) == 2
    assert "install iproute2" in capsys.readouterr().err


def test_bad_rate_on_the_command_line(capsys):
    from tiershard.cli import main
    assert main(["cluster", "up", "--inter-bw", "250mbps"]) == 2
    assert "ambiguous" in capsys.readouterr().err


class FakeIp:
    """Stands in for ip/tc: tracks namespaces, optionally interrupts at the n-th command."""

    def __init__(self, interrupt_at: int | None = None, exc: type[BaseException] = KeyboardInterrupt):
        self.namespaces: set[str] = set()
        self.calls: list[list[str]] = []
        self.interrupt_at, self.exc = interrupt_at, exc

    def __call__(self, cmd, tools, check=True):
        self.calls.append(list(cmd))
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise self.exc()
        out = ""
        if cmd[:3] == ["ip", "netns", "add"]:
            self.namespaces.add(cmd[3])
        elif cmd[:3] == ["ip", "netns", "del"]:
            self.namespaces.discard(cmd[3])
        elif cmd[:3] == ["ip", "netns", "list"]:
            out = "\n".join(f"{ns} (id: 1)" for ns in sorted(self.namespaces)) + "\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_up_leaves_nothing(monkeypatch, tmp_path, exc):
    fake = FakeIp(interrupt_at=12, exc=exc)
    fake.namespaces.add("ts-other-n0")                      # another cluster: must survive
    monkeypatch.setattr(host, "run_ip", fake)
    monkeypatch.setattr(host, "STATE_DIR", tmp_path / "state")
    cluster = EmulatedCluster(3, 2, "250mbit", name="mid")
    cluster._tools = {"ip": "ip", "tc": "tc"}
    with pytest.raises(exc):
        cluster.up()
    assert any(c[:3] == ["ip", "netns", "add"] for c in fake.calls[:11])   # it did get half-way
    assert fake.namespaces == {"ts-other-n0"}
    assert not (tmp_path / "state").exists()


def test_existing_cluster_is_refused_or_replaced(monkeypatch, tmp_path):
    fake = FakeIp()
    monkeypatch.setattr(host, "run_ip", fake)
    monkeypatch.setattr(host, "STATE_DIR", tmp_path / "s")
    first = EmulatedCluster(2, 1, None, name="dup")
    first._tools = {"ip": "ip", "tc": "tc"}
    first.up()
    second = EmulatedCluster(2, 1, None, name="dup")
    second._tools = first._tools
    with pytest.raises(ClusterError, match="already up.*cluster down.*--replace"):
        second.up()
    second.replace = True
    second.up()
    assert fake.namespaces == {"ts-dup-sw", "ts-dup-n0", "ts-dup-n1"}
    second.down()
    assert fake.namespaces == set() and not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------------------------
# A real cluster (root and network namespaces only)


def _netns_works() -> str | None:
    """None if this process may create network namespaces, else why not."""
    from tiershard.cluster.emulated import namespaces_unavailable

    return namespaces_unavailable("probe")


def _ts_namespaces() -> set[str]:
    return {ns for ns in tc.list_namespaces() if ns.startswith(tc.PREFIX)}


@pytest.fixture(scope="module")
def netns():
    reason = _netns_works()
    if reason:
        pytest.skip(reason)


def _on_the_wire(counted: int, payload: int) -> bool:
    """A link counter against the payload a formula gives: the counter sees whole frames, so it reads up to about 8%
    more (Ethernet, IP and TCP headers of 66 bytes per 1448-byte segment are 4.6%; the ACKs for what the node
    receives, one per one or two segments, add 2-4%) and never less than the payload."""
    return 0.99 * payload <= counted <= 1.09 * payload


def test_real_cluster_allreduce_bytes_match_the_ring_formula(netns, capsys):
    before = _ts_namespaces()
    name = f"t{os.getpid() % 100000}"
    nbytes = 8 * MiB
    with EmulatedCluster(2, 2, "1gbit", name=name) as cluster:
        assert {ns for ns in _ts_namespaces() - before} == {f"ts-{name}-sw", f"ts-{name}-n0", f"ts-{name}-n1"}
        assert cluster.bandwidth() == 10**9
        assert all(cap == {"uplink": 10**9, "port": 10**9} for cap in cluster.link_caps())

        start = cluster.nic_bytes()
        results = cluster.launch([sys.executable, "-m", "tiershard.cluster", "allreduce", "--bytes", str(nbytes),
                                  "--iters", "1", "--warmup", "0"], timeout=120)
        end = cluster.nic_bytes()
        assert [r.returncode for r in results] == [0, 0, 0, 0]
        expected = ring_allreduce_nic_bytes(nbytes, 2, 2)              # one world all_reduce; node phase adds ~0
        for node in (0, 1):
            for key in ("tx", "rx"):
                sent = end[node][key] - start[node][key]
                assert _on_the_wire(sent, expected), (node, key, sent, expected)
        summary = {s["phase"]: s for s in tc.summarize_allreduce(results, 2, 2)}
        for node in (0, 1):
            world_tx = summary["world"]["nic"][node]["tx"]
            assert _on_the_wire(world_tx, expected), (node, world_tx, expected)
            assert summary["node"]["nic"][node]["tx"] < 64 * 1024          # intra-node: over loopback, not the NIC

        # a failing rank: the error names it and carries its stderr; the other ranks are stopped
        script = "import os, sys, time\nif os.environ['RANK'] == '2': sys.exit('rank two gives up')\ntime.sleep(60)"
        with pytest.raises(LaunchError, match="rank 2 \\(node 1\\) exited with code 1") as err:
            cluster.launch([sys.executable, "-c", script], timeout=60)
        assert "rank two gives up" in str(err.value)

        cluster.set_bandwidth("none")
        assert cluster.bandwidth() is None and cluster.link_caps()[1] == {"uplink": None, "port": None}
        cluster.set_bandwidth(None)                                        # removing no cap is fine

        from tiershard.cli import main
        assert main(["cluster", "status", "--name", name]) == 0
        out = capsys.readouterr().out
        assert "10.77.0.2" in out and f"ts-{name}-n1" in out and "cap none" in out
        assert main(["cluster", "up", "--name", name]) == 2
        assert "already up" in capsys.readouterr().err
    assert _ts_namespaces() == before
    assert not host.state_path(name).exists()


def test_real_interrupted_up_and_exception_in_with_leave_nothing(netns, monkeypatch):
    before = _ts_namespaces()
    name = f"i{os.getpid() % 100000}"
    real_run, calls = host.run_ip, []

    def interrupting(cmd, tools, check=True):
        calls.append(cmd)
        if len(calls) == 9:                    # after the switch and node 0's namespace exist
            raise KeyboardInterrupt
        return real_run(cmd, tools, check)

    monkeypatch.setattr(host, "run_ip", interrupting)
    with pytest.raises(KeyboardInterrupt):
        EmulatedCluster(2, 1, "250mbit", name=name).up()
    monkeypatch.setattr(host, "run_ip", real_run)
    assert _ts_namespaces() == before

    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, 1, "250mbit", name=name):
            assert f"ts-{name}-n1" in _ts_namespaces()
            raise RuntimeError("boom")
    assert _ts_namespaces() == before


# ---------------------------------------------------------------------------------------------------------------
# Three tiers: groups of ranks in their own namespaces behind a node bridge


def test_three_tier_up_commands_cap_group_links_and_node_uplinks():
    cmds = up_commands("m3", 2, 250_000_000, 2, 2 * 10**9)
    made = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert made == ["ts-m3-sw", "ts-m3-n0", "ts-m3-n0g0", "ts-m3-n0g1", "ts-m3-n1", "ts-m3-n1g0", "ts-m3-n1g1"]
    caps = {(c[2], c[6], c[10]) for c in cmds if c[0] == "tc"}
    top = {(f"ts-m3-n{i}", "eth0", "250000000bit") for i in range(2)} | \
        {("ts-m3-sw", f"p{i}", "250000000bit") for i in range(2)}
    middle = {(f"ts-m3-n{i}g{j}", "eth0", "2000000000bit") for i in range(2) for j in range(2)} | \
        {(f"ts-m3-n{i}", f"q{j}", "2000000000bit") for i in range(2) for j in range(2)}
    assert caps == top | middle
    addrs = {c[2]: c[5] for c in cmds if c[3:5] == ["addr", "add"]}     # only the groups have addresses
    assert addrs == {"ts-m3-n0g0": "10.77.0.1/24", "ts-m3-n0g1": "10.77.0.2/24", "ts-m3-n1g0": "10.77.0.3/24",
                     "ts-m3-n1g1": "10.77.0.4/24"}
    ports = {(c[2], c[5]) for c in cmds if c[3:4] == ["link"] and c[6:7] == ["master"]}
    assert {(f"ts-m3-n{i}", "eth0") for i in range(2)} <= ports           # the node uplink is a bridge port
    assert cluster_namespaces(made + ["ts-m3-n0g", "ts-m3-g0"]) == {"m3": sorted(made[1:]) + ["ts-m3-sw"]}
    assert up_commands("m3", 2, 250_000_000) == up_commands("m3", 2, 250_000_000, 1, None)   # two tiers unchanged


def test_three_tier_rank_env_gives_the_topology_and_one_host_per_node(monkeypatch):
    from tiershard.topology import Topology, TopologyError

    envs = [rank_env(r, 2, 4, 29511, groups_per_node=2, cluster="m3") for r in range(8)]
    assert [(e["LOCAL_WORLD_SIZE"], e["NODE_RANK"], e["LOCAL_RANK"]) for e in envs[3:5]] == [("4", "0", "3"),
                                                                                           ("4", "1", "0")]
    assert {e["TIERSHARD_TOPOLOGY"] for e in envs} == {"2,4,8"} and envs[7]["MASTER_ADDR"] == "10.77.0.1"
    assert envs[5]["TIERSHARD_NODE_NETNS"] == "ts-m3-n1"
    for key, value in envs[5].items():
        monkeypatch.setenv(key, value)
    topo = Topology.from_env()
    assert (topo.sizes, topo.names) == ((2, 4, 8), ("pair", "node", "world"))
    hosts = [e["TIERSHARD_HOST_ID"] for e in envs]
    assert len(set(hosts[:4])) == 1 and len(set(hosts)) == 2
    topo.check_hosts(hosts)                                            # groups of a node: one host
    Topology((4, 8)).check_hosts(hosts)                                # nodes of 4: the same hosts, also right
    with pytest.raises(TopologyError, match="spans 2 hosts.*declare Topology\\(\\(2, 4, 8\\)\\)"):
        Topology((2, 8, 8)).check_hosts(hosts)                         # a node of 8 would cross the network
    two = rank_env(3, 2, 2, 29511)
    assert not {"TIERSHARD_TOPOLOGY", "TIERSHARD_HOST_ID", "TIERSHARD_NODE_NETNS"} & two.keys()


def test_tiers_and_rates_by_tier():
    c = EmulatedCluster.from_tiers((2, 4, 8), ("none", "2gbit", "250mbit"), name="m3")
    assert (c.nodes, c.ranks_per_node, c.groups_per_node, c.ranks_per_group) == (2, 4, 2, 2)
    assert (c.tiers, c.tier_names, c.tier_rates) == ((2, 4, 8), ("pair", "node", "world"),
                                                     (None, 2 * 10**9, 250_000_000))
    c._tools = {"ip": "/sbin/ip", "tc": "/sbin/tc"}
    assert [c.rank_namespace(r) for r in (0, 1, 2, 5, 7)] == ["ts-m3-n0g0", "ts-m3-n0g0", "ts-m3-n0g1",
                                                               "ts-m3-n1g0", "ts-m3-n1g1"]
    assert (c.rank_address(2), c.node_address(1)) == ("10.77.0.2", "10.77.0.3")
    two = EmulatedCluster.from_tiers((2, 4), ("none", "1gbit"))
    assert (two.nodes, two.ranks_per_node, two.groups_per_node, two.inter_bw, two.tiers) == (2, 2, 1, 10**9, (2, 4))
    for tiers, rates, words in [((2, 4, 8), ("1gbit", "2gbit", "250mbit"), "loopback"),
                                ((2, 4, 8), ("none", "250mbit"), "2 rates for 3 tiers"),
                                ((3, 4, 8), ("none",) * 3, "multiple"), ((4, 4), ("none",) * 2, "2 or more"),
                                ((2, 4, 8, 16), ("none",) * 4, "2 or 3"), ((2, 4, 8), ("none", "2GB/s", "1gbit"),
                                                                            "ambiguous")]:
        with pytest.raises(ClusterError, match=words):
            EmulatedCluster.from_tiers(tiers, rates)
    with pytest.raises(ClusterError, match="groups_per_node=3"):
        EmulatedCluster(2, 4, groups_per_node=3)
    with pytest.raises(ClusterError, match="one group per node"):
        EmulatedCluster(2, 4, node_bw="1gbit")


def test_ring_allreduce_bytes_per_tier():
    assert tc.ring_allreduce_tier_bytes(64 * MiB, (2, 4)) == {"world": 96 * MiB}
    # 8 ranks: each group sends one ring edge of 2(n-1)/n = 1.75 x the buffer; one of a node's two leaves the node
    assert tc.ring_allreduce_tier_bytes(64 * MiB, (2, 4, 8)) == {"world": 112 * MiB, "node": 112 * MiB}
    assert tc.ring_allreduce_tier_bytes(64 * MiB, (1, 4, 8)) == {"world": 112 * MiB, "node": 3 * 112 * MiB}


def test_real_three_tier_cluster_counts_each_tier_and_shards(netns):
    """2 nodes x 2 groups x 1 rank: per-tier link bytes of a world all_reduce against the ring formula (read inside
    the ranks, and from outside), ts.shard with the launcher's topology against an unsharded step, and a topology
    whose node spans both nodes refused."""
    before = _ts_namespaces()
    name = f"k{os.getpid() % 100000}"
    job = os.path.join(os.path.dirname(__file__), "_shard_job.py")
    with EmulatedCluster.from_tiers((1, 2, 4), ("none", "2gbit", "1gbit"), name=name) as cluster:
        caps = cluster.link_caps()
        assert [c["uplink"] for c in caps] == [10**9] * 2
        assert all(g == {"uplink": 2 * 10**9, "port": 2 * 10**9} for c in caps for g in c["groups"])
        start = cluster.tier_nic_bytes()
        results = cluster.launch([sys.executable, job, "IIG"], timeout=180)
        end = cluster.tier_nic_bytes()
    assert _ts_namespaces() == before
    out = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    expected = tc.ring_allreduce_tier_bytes(4 * MiB, (1, 2, 4))
    for o in out:
        assert (o["sizes"], o["names"], o["local_world_size"]) == ([1, 2, 4], ["pair", "node", "world"], 2)
        assert o["max_diff"] < 1e-5, o
        assert o["mismatch"] and "spans 2 hosts" in o["mismatch"], o["mismatch"]
    for node in (0, 1):
        first = out[2 * node]["links"]                 # rank 2*node: first of its group and of its node
        second = out[2 * node + 1]["links"]
        uplink, middle = first["uplink"], first["eth0"] + second["eth0"] - first["uplink"]
        assert _on_the_wire(uplink, expected["world"]), (node, uplink, expected)
        assert _on_the_wire(middle, expected["node"]), (node, middle, expected)
        for tier in ("world", "node"):                 # the whole launch, from outside: at least the all_reduce
            assert end[tier][node]["tx"] - start[tier][node]["tx"] >= expected[tier]


def _communicate_all(procs: list, timeout: float) -> list[tuple]:
    """(returncode, stdout, stderr) of every process, read at once: when one fails or `timeout` passes the rest are
    killed (torchrun's exit barrier would keep a finished agent waiting minutes for a failed peer) and their
    returncode is None, so a failure names every agent's story instead of a timeout on the first."""
    import threading
    import time
    outs = [("", "")] * len(procs)

    def read(i: int) -> None:
        outs[i] = procs[i].communicate()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    killed = [p.poll() is None for p in procs]
    for proc, kill in zip(procs, killed):
        if kill:
            proc.kill()
    for t in threads:
        t.join(10)
    return [(None if k else p.returncode, *o) for p, k, o in zip(procs, killed, outs)]


def test_real_torchrun_multi_node_recipe(netns):
    """docs/launchers.md's multi-node torchrun recipe, one torchrun per emulated node (c10d rendezvous at node
    0's address): ts.shard with Topology.from_env() matches an unsharded step."""
    before = _ts_namespaces()
    name = f"r{os.getpid() % 100000}"
    job = os.path.join(os.path.dirname(__file__), "_shard_job.py")
    port = 29400 + os.getpid() % 500
    with EmulatedCluster(2, 2, "1gbit", name=name) as cluster:
        procs = []
        for node in (0, 1):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={cluster.node_address(0)}:{port}", "--rdzv-id=t",
                    f"--local-addr={cluster.node_address(node)}", f"--rdzv-conf=is_host={int(node == 0)}", job,
                    "IIG"]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
                   "SHARD_JOB_WATCHDOG_S": "120"}
            procs.append(subprocess.Popen(cluster.node_command(node, argv), env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        results = _communicate_all(procs, timeout=240)
    for node, (code, stdout, stderr) in enumerate(results):    # every agent's story when one fails or hangs
        assert code == 0, "\n\n".join(f"node {n} exit {c}:\n{e[-2500:]}" for n, (c, _, e) in enumerate(results))
    outputs = [json.loads(line) for _, stdout, _ in results for line in stdout.splitlines() if line.startswith("{")]
    assert _ts_namespaces() == before
    assert sorted(o["rank"] for o in outputs) == [0, 1, 2, 3]
    for o in outputs:
        assert (o["sizes"], o["names"], o["local_world_size"]) == ([2, 4], ["node", "world"], 2)
        assert o["max_diff"] < 1e-5, o
        assert o["mismatch"] and "spans 2 hosts" in o["mismatch"]
