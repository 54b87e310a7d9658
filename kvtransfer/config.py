"""TransferConfig: sizes, deadlines and lease lifetimes of the KV wire (holder and puller)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve import envs
from pdserve.security import DEFAULT_MAX_NONCES, TLSConfig, check_secret

MiB = 1 << 20
# The sizes a region may have (a page up to 1 GiB): kvtransfer.shm imports them from here.
MIN_REGION_BYTES = 4096
MAX_REGION_BYTES = 1 << 30

# Upper bound of the protobuf framing of one BlockPiece inside a PullChunk, data excluded:
# index/num_tokens/offset varints, a hash of <= MAX_HASH_BYTES, the fixed64 checksum,
# tags and length prefixes (about 60 bytes in practice).
PIECE_OVERHEAD_BYTES = 128
MAX_HASH_BYTES = 64
# Upper bound of a PullChunk's own fields (seq and totals).
CHUNK_HEADER_BYTES = 1024
# gRPC's hard limit on one message is 2 GiB - 1; stay well clear of it.
MAX_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True)
class TransferConfig:
    """Settings shared by the holder (server) and the puller (client) of KV blocks.

    ``chunk_bytes`` caps the payload (block bytes) of one stream message and
    ``max_blocks_per_chunk`` the pieces in it; together they bound a message, and
    ``max_message_bytes`` (both sides' gRPC message limit) is derived from them. A puller
    sends its own caps with each pull and the holder uses the smaller of each, so a
    message never exceeds the puller's receive limit. Blocks larger than a chunk are split.
    Every RPC carries a deadline: ``metadata_timeout_s``, ``pull_timeout_s`` (the whole
    stream) and ``release_timeout_s``.

    Security (docs/kv-wire.md): with ``cluster_secret`` every call is authenticated by a token
    bound to it (method, request bytes, a nonce used once) and a holder refuses the others
    (``UNAUTHENTICATED``); a holder remembers at most ``auth_max_nonces`` tokens of the last
    minute and refuses calls beyond (sized for ~2,000 calls/s). ``tls`` puts the plane on TLS
    (mutual with a CA): the only protection of the block bytes from someone reading the network.
    Abuse bounds on a holder: at most ``max_pulls_per_peer`` pulls stream to one peer host at once
    (a puller keeps to the same number on its side), a stream that cannot send its next chunk
    for ``stall_timeout_s`` or runs past ``pull_timeout_s`` is cancelled, and calls beyond
    ``server_threads`` are refused (``RESOURCE_EXHAUSTED``) instead of queued. A puller, in turn,
    gives up a pull whose holder says nothing for ``holder_silence_s`` (a hung holder).

    Same-host transport (``kvtransfer/shm.py``, docs/kv-wire.md): with ``shm`` a holder also serves
    pulls into staging regions that its pullers hand it over its Unix socket (in a fresh 0700
    directory under ``shm_dir``; None: ``$XDG_RUNTIME_DIR`` when it is the user's own, else the temp
    directory), and a puller uses them for holders on its own kernel and user, gRPC otherwise and as
    the fallback. A puller keeps up to ``shm_regions`` regions of ``shm_region_bytes`` per holder
    (made on demand, one per concurrent pull; a pull finding all in use goes over gRPC), each a ring
    of ``shm_slot_bytes`` slots; a holder maps at most ``shm_max_regions`` regions of all its
    pullers. Attach and pull tickets are good for ``shm_ticket_ttl_s``. A region unused for
    ``shm_region_idle_s`` is ended (its memory goes back) at the puller's next ``trim`` (a worker's
    ``region-trim`` thread calls it).

    NIXL transport (``kvtransfer/nixl*.py``, the optional ``pdserve[nixl]`` extra, docs/kv-wire.md):
    with ``nixl`` a holder also serves PullNixl when the library loads, and a puller uses it for a
    holder that offers it where shm does not apply (another host), gRPC otherwise and as the fallback.
    A puller keeps one staging region of ``nixl_region_bytes`` per holder (registered with its own
    agent, ended after ``shm_region_idle_s`` unused); a pull larger than it goes in windows of that
    size. A holder keeps the metadata of at most ``nixl_max_peers`` puller agents (the least recently
    used goes first).
    """

    chunk_bytes: int = 2 * MiB  # 1-2 MiB measured fastest over loopback (docs/performance.md, "KV transfer")
    max_blocks_per_chunk: int = 1024
    lease_ttl_s: float = 30.0
    reap_interval_s: float = 1.0
    metadata_timeout_s: float = 5.0
    pull_timeout_s: float = 60.0
    release_timeout_s: float = 5.0
    server_threads: int = 32
    max_pulls_per_peer: int = 8
    stall_timeout_s: float = 5.0
    shutdown_grace_s: float = 1.0
    cluster_secret: str | None = field(default_factory=envs.cluster_secret, repr=False)
    tls: TLSConfig | None = None
    auth_max_nonces: int = DEFAULT_MAX_NONCES
    # Where a worker's transfer server listens: "LO-HI" (the first free port of the range, so a
    # firewall can name them); None: any free port.
    port_range: str | None = None
    shm: bool = True
    shm_dir: str | None = None
    shm_ticket_ttl_s: float = 5.0
    shm_region_bytes: int = 32 * MiB
    shm_slot_bytes: int = 4 * MiB
    shm_regions: int = 4
    shm_max_regions: int = 64
    shm_region_idle_s: float = 30.0  # a puller ends a staging region unused this long (the next pull makes one)
    nixl: bool = False
    nixl_region_bytes: int = 64 * MiB
    nixl_max_peers: int = 64

    def __post_init__(self) -> None:
        self.ports()  # validates port_range
        for name in ("shm", "nixl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.nixl_region_bytes, int) or not 1 <= self.nixl_region_bytes <= MAX_REGION_BYTES:
            raise ValueError(f"nixl_region_bytes must be an integer in [1, {MAX_REGION_BYTES}], got {self.nixl_region_bytes!r}")
        if self.shm_dir is not None and (not isinstance(self.shm_dir, str) or not self.shm_dir):
            raise ValueError(f"shm_dir must be a non-empty path or None, got {self.shm_dir!r}")
        if not isinstance(self.chunk_bytes, int) or not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be an integer in [1, {MAX_CHUNK_BYTES}], got {self.chunk_bytes!r}")
        if not isinstance(self.max_blocks_per_chunk, int) or not 1 <= self.max_blocks_per_chunk <= 1 << 20:
            raise ValueError(f"max_blocks_per_chunk must be an integer in [1, 2**20], got {self.max_blocks_per_chunk!r}")
        region = self.shm_region_bytes
        if not isinstance(region, int) or not MIN_REGION_BYTES <= region <= MAX_REGION_BYTES:
            bounds = f"[{MIN_REGION_BYTES}, {MAX_REGION_BYTES}]"
            raise ValueError(f"shm_region_bytes must be an integer in {bounds}, got {region!r}")
        if not isinstance(self.shm_slot_bytes, int) or not 1 <= self.shm_slot_bytes <= self.shm_region_bytes:
            raise ValueError(f"shm_slot_bytes must be an integer in [1, shm_region_bytes], got {self.shm_slot_bytes!r}")
        for name in ("server_threads", "max_pulls_per_peer", "auth_max_nonces", "shm_regions", "shm_max_regions",
                     "nixl_max_peers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        check_secret(self.cluster_secret)
        for name in ("lease_ttl_s", "reap_interval_s", "metadata_timeout_s", "pull_timeout_s", "release_timeout_s",
                     "stall_timeout_s", "shm_ticket_ttl_s", "shm_region_idle_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.shutdown_grace_s, (int, float)) or not 0 <= self.shutdown_grace_s < math.inf:
            raise ValueError(f"shutdown_grace_s must be a finite number >= 0, got {self.shutdown_grace_s!r}")

    @property
    def holder_silence_s(self) -> float:
        """How long a puller waits for any word from a holder within a pull (a chunk, a slot, an
        answer) before it gives the pull up (``TransferTimeoutError``): twice ``stall_timeout_s``. A
        live holder cancels a stream it cannot advance for ``stall_timeout_s`` itself (a prefix wait
        included: the holder caps it at half that), so only a hung one (stopped, wedged, its host
        gone without a reset) is silent this long, and it then holds the puller's thread this long,
        not for the whole ``pull_timeout_s``."""
        return 2 * self.stall_timeout_s

    def ports(self) -> range:
        """The ports a transfer server may take, in the order tried (``range(0, 1)``: any free port)."""
        if self.port_range is None:
            return range(0, 1)
        lo, sep, hi = str(self.port_range).partition("-")
        try:
            first, last = int(lo), int(hi)
        except ValueError:
            first = last = -1
        if not sep or not 1 <= first <= last <= 65535:
            raise ValueError(f"port_range must be LO-HI with 1 <= LO <= HI <= 65535, got {self.port_range!r}")
        return range(first, last + 1)

    @property
    def max_message_bytes(self) -> int:
        """Largest stream message these caps allow: payload plus worst-case framing."""
        return message_bytes_for(self.chunk_bytes, self.max_blocks_per_chunk)

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC options for a puller's channel (receives chunks, sends small requests)."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC options for a holder's server (sends chunks, receives hash lists)."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", max(self.max_message_bytes, 4 * MiB)),
            # gRPC binds with SO_REUSEPORT by default: a second server on a taken port would
            # "succeed" and the kernel would split connections between the two.
            ("grpc.so_reuseport", 0),
        ]


def message_bytes_for(chunk_bytes: int, max_blocks_per_chunk: int) -> int:
    """Upper bound of a PullChunk carrying ``chunk_bytes`` payload in ``max_blocks_per_chunk`` pieces."""
    return chunk_bytes + max_blocks_per_chunk * PIECE_OVERHEAD_BYTES + CHUNK_HEADER_BYTES
