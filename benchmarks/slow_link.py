"""An emulated slow inter-node link, for benchmarking the hierarchical ring on one host (GPU only).

All GPUs of one benchmark machine share NVLink, so the two-level ring cannot show what it is for:
keeping a slow inter-node hop off the critical path. ``set_slow_link(SlowLink(ranks_per_node,
gbytes_per_s))`` declares a node boundary every ``ranks_per_node`` global ranks; from then on
every ring transfer whose incoming hop crosses a boundary is delayed as if it travelled at
``gbytes_per_s`` (plus ``latency_us``):

* at ``exchange`` time, a per-ring side stream waits for the current stream (the moment the
  transfer is posted) and then sleeps for ``latency + bytes / bandwidth`` (``torch.cuda._sleep``);
* ``Pending.wait()`` makes the current stream wait for that sleep as well as for NCCL.

So the data "arrives" at ``max(NVLink transfer done, posted + link time)``; the delay overlaps
with compute as a slow link's would, and successive transfers over one ring queue behind each
other (one link, shared bandwidth). It is a receiver-side model: the sender's send completes
at NVLink speed, and the link time starts when the receiver posts its receive (a late sender is
under-charged). Nothing else changes: results are identical.
It plugs into the ring's transfers as their arrival hook: the ring benchmark passes
``emulated_arrival`` as ``Settings.ring_arrival_hook`` of its calls (``ring.py``'s ``ring_settings``);
training passes none.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

__all__ = ["SlowLink", "LinkDelay", "emulated_arrival", "get_slow_link", "set_slow_link"]


@dataclasses.dataclass(frozen=True)
class SlowLink:
    """Nodes of ``ranks_per_node`` consecutive global ranks joined by a ``gbytes_per_s`` link."""

    ranks_per_node: int
    gbytes_per_s: float
    latency_us: float = 0.0

    def __post_init__(self):
        if int(self.ranks_per_node) < 1:
            raise ValueError(f"SlowLink: ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if not self.gbytes_per_s > 0:
            raise ValueError(f"SlowLink: gbytes_per_s must be > 0, got {self.gbytes_per_s}")
        if self.latency_us < 0:
            raise ValueError(f"SlowLink: latency_us must be >= 0, got {self.latency_us}")

    def crosses(self, src: int, dst: int) -> bool:
        """Whether a transfer between these global ranks goes over the slow link."""
        return src // self.ranks_per_node != dst // self.ranks_per_node

    def delay_ms(self, nbytes: int) -> float:
        return self.latency_us / 1e3 + nbytes / (self.gbytes_per_s * 1e9) * 1e3


_LINK: Optional[SlowLink] = None
_CYCLES_PER_MS: Dict[int, float] = {}


def _cycles_per_ms(device: int) -> float:
    """GPU clock cycles per millisecond for ``torch.cuda._sleep`` (measured once per device:
    one synchronisation, at set-up)."""
    if device not in _CYCLES_PER_MS:
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)  # warm-up launch
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            _CYCLES_PER_MS[device] = 20_000_000 / start.elapsed_time(end)
    return _CYCLES_PER_MS[device]


def set_slow_link(link: Optional[SlowLink]) -> None:
    """The link ``emulated_arrival`` emulates from now on (None: off). Needs CUDA."""
    global _LINK
    if link is not None:
        if not torch.cuda.is_available():
            raise RuntimeError("the slow-link emulation needs CUDA (it delays transfers with GPU sleeps)")
        _cycles_per_ms(torch.cuda.current_device())
    _LINK = link


# (incoming hop's receiver, device) -> its link's delay: one sleep stream per receiving rank, shared by
# every ring into it (the flat ring and the hierarchical outer ring; the benchmark runs them one after
# the other, so they never queue behind each other's transfers).
_DELAYS: Dict[Tuple[int, int], "LinkDelay"] = {}


def emulated_arrival(ring, received) -> Optional[torch.cuda.Event]:
    """The arrival hook: for a transfer into ``ring``'s member over a hop that crosses a node
    boundary, the event it "arrives" at; None for hops inside a node."""
    link = _LINK
    if link is None or not link.crosses(ring.prev_rank, ring.global_rank):
        return None
    key = (ring.global_rank, received[0].device.index)
    if key not in _DELAYS or _DELAYS[key].link != link:
        _DELAYS[key] = LinkDelay(link, received[0].device.index)
    return _DELAYS[key].arrival(sum(t.numel() * t.element_size() for t in received))


def get_slow_link() -> Optional[SlowLink]:
    return _LINK


class LinkDelay:
    """The emulated link into one ring member: a side stream of sleeps, one per transfer."""

    def __init__(self, link: SlowLink, device: int):
        self.link = link
        self.stream = torch.cuda.Stream(device=device)
        self.cycles_per_ms = _cycles_per_ms(device)

    def arrival(self, nbytes: int) -> torch.cuda.Event:
        """An event that completes ``delay_ms(nbytes)`` after the transfer is posted (now, on the
        current stream), and after the previous transfers over this link."""
        posted = torch.cuda.Event()
        posted.record()
        self.stream.wait_event(posted)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(max(1, int(self.link.delay_ms(nbytes) * self.cycles_per_ms)))
        arrived = torch.cuda.Event()
        arrived.record(self.stream)
        return arrived
