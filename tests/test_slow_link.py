"""The emulated slow inter-node link of the ring benchmark (benchmarks/slow_link.py), through the
ring's transfer arrival hook (ring/comm.py)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import slow_link  # noqa: E402
from slow_link import SlowLink  # noqa: E402

from megatron_mtraining.ring import comm  # noqa: E402


def test_link_geometry_and_delay():
    link = SlowLink(ranks_per_node=2, gbytes_per_s=10.0, latency_us=5.0)
    assert not link.crosses(0, 1) and link.crosses(1, 2) and link.crosses(3, 0) and not link.crosses(2, 3)
    assert link.delay_ms(10**9) == pytest.approx(100.0 + 0.005)
    assert link.delay_ms(0) == pytest.approx(0.005)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ranks_per_node=0, gbytes_per_s=1.0), "ranks_per_node"),
    (dict(ranks_per_node=2, gbytes_per_s=0.0), "gbytes_per_s"),
    (dict(ranks_per_node=2, gbytes_per_s=1.0, latency_us=-1.0), "latency_us"),
])
def test_link_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlowLink(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_needs_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        slow_link.set_slow_link(SlowLink(2, 1.0))
    assert slow_link.get_slow_link() is None


def test_only_cross_node_hops_are_delayed(monkeypatch):
    delays = []

    class FakeDelay:
        def __init__(self, link, device):
            self.link = link

        def arrival(self, nbytes):
            delays.append(nbytes)
            return "arrival"

    monkeypatch.setattr(slow_link, "_LINK", SlowLink(2, 1.0))
    monkeypatch.setattr(slow_link, "LinkDelay", FakeDelay)
    monkeypatch.setattr(slow_link, "_DELAYS", {})
    received = [torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float64)]
    ranks = [10, 11, 12, 13]  # global ranks; nodes {10, 11} and {12, 13}
    arrival = slow_link.emulated_arrival
    assert arrival(comm.Ring(None, ranks, 1), received) is None   # 10 -> 11: same node
    assert arrival(comm.Ring(None, ranks, 2), received) == "arrival"  # 11 -> 12: crosses
    assert arrival(comm.Ring(None, ranks, 0), received) == "arrival"  # 13 -> 10: crosses
    assert delays == [4 * 8 * 4 + 4 * 8 * 8] * 2
    monkeypatch.setattr(slow_link, "_LINK", None)
    assert arrival(comm.Ring(None, ranks, 2), received) is None   # off: nothing


def test_the_hook_travels_with_the_ring_and_reaches_every_posted_transfer(monkeypatch):
    """Training's rings carry no hook (``Settings().ring_arrival_hook`` is None); a ring given one
    calls it with each exchange's ring and buffers, and its event goes into the Pending that the
    schedule waits on. Nothing in ``comm`` holds a hook for other rings."""
    from megatron_mtraining.config import Settings
    assert Settings().ring_arrival_hook is None and comm.Ring(None, [0, 1], 1).arrival_hook is None
    assert not hasattr(comm, "_ARRIVAL_HOOK") and not hasattr(comm, "set_arrival_hook")
    seen = []
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: [])
    monkeypatch.setattr(comm.dist, "P2POp", lambda *args: args)
    hook = lambda ring, received: seen.append((ring.global_rank, len(received))) or "event"  # noqa: E731
    pending = comm.Ring(None, [0, 1], 1, arrival_hook=hook).exchange([torch.zeros(2), torch.zeros(3)])
    assert seen == [(1, 2)] and pending._arrival == "event"
    assert comm.Ring(None, [0, 1], 1).exchange([torch.zeros(2)])._arrival is None  # another ring: none
    topo = comm.RingTopology(2, 1, comm.Ring(None, [0, 1], 1), comm.Ring(None, [1], 0))
    hooked = topo.with_arrival_hook(hook)
    assert hooked.inner.arrival_hook is hook and hooked.outer.arrival_hook is hook
    assert topo.inner.arrival_hook is None  # the cached topology is unchanged
    with pytest.raises(ValueError, match="ring_arrival_hook must be None or callable"):
        Settings(ring_arrival_hook="slow")


def test_the_ring_benchmark_gives_its_calls_the_hook_only_with_a_link():
    import ring as ring_benchmark  # benchmarks/ring.py

    assert ring_benchmark.ring_settings(ring_benchmark.Config(seq_lens=[256])) is None
    settings = ring_benchmark.ring_settings(ring_benchmark.Config(seq_lens=[256], slow_link_gbps=2.0))
    assert settings.ring_arrival_hook is slow_link.emulated_arrival


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_arrival_waits_for_the_link_time():
    link = SlowLink(1, 100.0)  # 1 GB at 100 GB/s: 10 ms
    delay = slow_link.LinkDelay(link, torch.cuda.current_device())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    arrived = delay.arrival(10**9)
    torch.cuda.current_stream().wait_event(arrived)
    end.record()
    end.synchronize()
    assert 8.0 < start.elapsed_time(end) < 14.0
