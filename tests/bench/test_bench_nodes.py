"""Two emulated nodes (network namespaces joined by a shaped veth pair) in `nfab bench step`.

The same W ranks, split 2 x W/2 across the nodes, must train bit for bit like one node of W
(the wire changes where bytes travel, never what they add up to), and the bytes counted on
the shaped link must match what the model predicts for plain DDP and nfab.
"""

import pytest
from typer.testing import CliRunner

from nfab.bench import nodes
from nfab.bench import step as step_mod
from nfab.cli.app import app
from nfab.errors import NfabError

needs_netns = pytest.mark.skipif(nodes.unavailable() is not None, reason=str(nodes.unavailable()))
LOSSY = ("nfab:bf16", "nfab:fp16", "nfab:q8", "nfab:q4", "nfab:sign")
TINY = dict(width=4, batch=2, steps=1, warmup=1, cost_model="none")  # cost_model none: same routes on any link
W4 = dict(variants=("plain", "floor", "nfab-fp32", *LOSSY), world_size=4, width=8, batch=2, steps=2, warmup=1,
          cost_model="none")


def _same_bits(one, two, variants, expect_routes):
    assert two["link"]["nodes"] == 2 and "tbf" in two["link"]["qdisc"]
    for v in variants:
        assert two["params_sha256"][v] == one["params_sha256"][v], v
        assert two["loss"][v] == one["loss"][v], v
    for v, route in expect_routes.items():  # the lossy route really ran (not a silent fp32 fallback)
        assert route in two["nfab"][v]["route_mix"], (v, two["nfab"][v]["route_mix"])


@pytest.fixture(scope="module")
def four_ranks():
    """W=4 as 2 emulated nodes x 2 ranks on a 1 Gbit/s link, and as one node: each variant once.
    Both tests below read these runs (a two-node run is start-up mostly: two node processes, their
    rank servers, the namespaces)."""
    two_cfg = step_mod.BenchConfig(nodes=2, link="1gbit", **W4)
    return two_cfg, step_mod.run(two_cfg), step_mod.run(step_mod.BenchConfig(**W4))


@pytest.mark.slow
@pytest.mark.world_size(4)
@needs_netns
def test_two_nodes_of_two_ranks_equal_one_node_of_four_bit_for_bit(four_ranks):
    _, two, one = four_ranks
    _same_bits(one, two, W4["variants"], {"nfab:bf16": "bf16", "nfab:fp16": "fp16", "nfab:q8": "q8",
                                          "nfab:q4": "q4", "nfab:sign": "signgather"})


@pytest.mark.slow
@pytest.mark.world_size(2)
@needs_netns
def test_q2_across_two_nodes_equals_one_node():
    # q2 is over capacity at W=4 (fewer than 2 levels per rank), so it is checked at W=2
    variants = ("plain", "nfab:q2")
    one = step_mod.run(step_mod.BenchConfig(variants=variants, world_size=2, **TINY))
    two = step_mod.run(step_mod.BenchConfig(variants=variants, world_size=2, nodes=2, link="1gbit", **TINY))
    _same_bits(one, two, variants, {"nfab:q2": "q2"})


@pytest.mark.slow
@pytest.mark.world_size(4)
@needs_netns
def test_link_bytes_measured_match_the_model(four_ranks):
    cfg, two, _ = four_ranks
    doc = step_mod.report(cfg, two, command="test")
    rows = {r["variant"]: r for r in doc["rows"]}
    for v in W4["variants"]:
        measured, modelled = rows[v]["measured_wire_bytes_per_step"], rows[v]["modelled_wire_bytes_per_step"]
        assert measured > 0 and modelled >= 0
        if v != "floor":  # the floor sends only buffers and barriers: headers dominate its few KB
            assert abs(measured / modelled - 1) < 0.2, (v, measured, modelled)
    # the ring crosses the link twice: plain sends 2 ranks' worth of 2(W-1)/W x 4 bytes per parameter
    assert rows["plain"]["modelled_wire_bytes_per_step"] > 2 * 1.5 * 4 * doc["parameters"]
    assert rows["nfab:sign"]["measured_wire_bytes_per_step"] < 0.2 * rows["plain"]["measured_wire_bytes_per_step"]


def test_node_options_are_checked_in_one_line():
    with pytest.raises(NfabError, match="needs --link"):
        step_mod.BenchConfig(nodes=2)
    with pytest.raises(NfabError, match="1 or 2"):
        step_mod.BenchConfig(nodes=3, link="1gbit")
    with pytest.raises(NfabError, match="divisible"):
        step_mod.BenchConfig(nodes=2, link="1gbit", world_size=3)
    with pytest.raises(NfabError, match="needs --nodes 2"):
        step_mod.BenchConfig(link="1gbit", delay="1ms")
    with pytest.raises(NfabError, match="tc time"):
        step_mod.BenchConfig(nodes=2, link="1gbit", delay="soon")
    with pytest.raises(NfabError, match="route"):
        step_mod.BenchConfig(variants=("nfab:zip",))


def test_cli_nodes_without_iproute2_exits_2_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip or tc here
    result = CliRunner().invoke(app, ["bench", "step", "--nodes", "2", "--link", "1gbit", "--world-size", "4"])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--nodes needs" in lines[0], result.output


def test_cli_nodes_without_link_exits_2_with_one_line():
    result = CliRunner().invoke(app, ["bench", "step", "--nodes", "2", "--world-size", "4"])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs --link" in lines[0], result.output


@needs_netns
def test_namespaces_are_removed_and_the_link_is_shaped_both_ways():
    with nodes.emulated_nodes(2, "100mbit") as (made, qdiscs), nodes.emulated_nodes(2, "1gbit") as (more, _):
        assert [n.address for n in made] == ["10.77.0.1", "10.77.0.2"]
        assert all("tbf" in q and "100Mbit" in q for q in qdiscs)
        names = [n.namespace for n in made + more]
        assert len(set(names)) == 4  # two contexts at once: namespaces (and veths) of their own
    import subprocess
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
