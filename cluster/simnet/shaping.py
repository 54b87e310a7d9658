"""Link profiles and shaping a node's link with ``tc``: rate (tbf), delay (netem, where the kernel has
it) and partition (a tbf that drops every frame).

A profile belongs to a node's link and holds in both directions: the root-namespace end's egress is the
node's download, the node end's egress its upload.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from pdserve.cluster.simnet.errors import SimnetError
from pdserve.cluster.simnet.netns import NODE_IFACE, cmd


@dataclass(frozen=True)
class LinkProfile:
    """A node's link: ``rate_bps`` (bits/s) and ``delay_ms``, both applied to each direction of the link.

    A packet between two nodes crosses both nodes' links, so its one-way delay is the sum of the two
    delays and the round trip twice that; its rate is the lower of the two.
    """

    name: str
    rate_bps: int
    delay_ms: float

    def burst_bytes(self) -> int:
        """tbf's bucket: about 1 ms at the rate, never under 128 KiB (a GSO packet is up to 64 KiB and
        tbf would split every larger one)."""
        return max(self.rate_bps // 8 // 1000, 128 * 1024)


PROFILES: dict[str, LinkProfile] = {
    "fast": LinkProfile("fast", 10_000_000_000, 0.2),  # a rack: 10 Gbit/s, 0.2 ms
    "slow": LinkProfile("slow", 1_000_000_000, 5.0),  # across zones: 1 Gbit/s, 5 ms
    # slow's delay at a fifth of its rate (a thin or oversubscribed link between zones): where pulling a long
    # prompt's KV loses to recomputing it on bandwidth alone (on slow, 768 tokens of the links bench's model
    # move in about the time they take to recompute; benchmarks/links.py)
    "thin": LinkProfile("thin", 200_000_000, 5.0),
    "wan": LinkProfile("wan", 100_000_000, 20.0),  # across regions: 100 Mbit/s, 20 ms
}


def profile_of(profile: str | LinkProfile) -> LinkProfile:
    """A profile by name (``PROFILES``), or the given one; SimnetError for an unknown name."""
    if isinstance(profile, LinkProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise SimnetError(f"unknown link profile {profile!r} (known: {', '.join(PROFILES)})") from None


def tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``tc ARGS``, inside namespace ``ns`` when given; SimnetError when it fails and ``check``."""
    return cmd(["tc", *(["-n", ns] if ns else []), *args], check)


def tbf_args(profile: LinkProfile, partitioned: bool) -> list[str]:
    """tbf's arguments for a link: the profile's rate, or, partitioned, a black hole: a 10-byte bucket
    drops every frame (all are larger) at enqueue, in the kernel, as netem's ``loss 100%`` would."""
    if partitioned:
        return ["tbf", "rate", "1kbit", "burst", "10", "latency", "1ms"]
    return ["tbf", "rate", f"{profile.rate_bps}bit", "burst", str(profile.burst_bytes()), "latency", "20ms"]


def shape(veth: str, netns: str, profile: LinkProfile, partitioned: bool, netem: bool) -> None:
    """Put ``profile`` (or a partition) on both ends of a node's veth: ``veth`` in the root namespace and
    ``eth0`` in ``netns``. The root qdisc, a tbf, limits the rate (or drops everything); with ``netem``
    the delay is a netem under it, else the nodes' delay daemons hold the packets (``delay.py``)."""
    tbf = tbf_args(profile, partitioned)
    for dev, ns in ((veth, None), (NODE_IFACE, netns)):
        tc("qdisc", "replace", "dev", dev, "root", "handle", "10:", *tbf, ns=ns)
        if netem:
            tc("qdisc", "replace", "dev", dev, "parent", "10:1", "handle", "20:", "netem", "delay",
               f"{profile.delay_ms}ms", "limit", "100000", ns=ns)  # fmt: skip
