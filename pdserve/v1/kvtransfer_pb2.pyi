from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayoutSpec(_message.Message):
    __slots__ = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "block_nbytes", "kv_scales", "kind", "rope_dim")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_nbytes: int
    kv_scales: _containers.RepeatedScalarFieldContainer[float]
    kind: str
    rope_dim: int
    def __init__(self, dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., kv_scales: _Optional[_Iterable[float]] = ..., kind: _Optional[str] = ..., rope_dim: _Optional[int] = ...) -> None: ...

class GetMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMetadataResponse(_message.Message):
    __slots__ = ("model_fingerprint", "layout", "worker_id", "max_chunk_bytes", "host_id", "shm_socket", "nixl")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    layout: KVLayoutSpec
    worker_id: str
    max_chunk_bytes: int
    host_id: str
    shm_socket: str
    nixl: bool
    def __init__(self, model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[KVLayoutSpec, _Mapping]] = ..., worker_id: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., host_id: _Optional[str] = ..., shm_socket: _Optional[str] = ..., nixl: _Optional[bool] = ...) -> None: ...

class BlockHashes(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("lease_id", "block_hashes", "first_block", "expected_layout", "max_chunk_bytes", "max_blocks_per_chunk", "prefix_wait_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_hashes: BlockHashes
    first_block: int
    expected_layout: KVLayoutSpec
    max_chunk_bytes: int
    max_blocks_per_chunk: int
    prefix_wait_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., block_hashes: _Optional[_Union[BlockHashes, _Mapping]] = ..., first_block: _Optional[int] = ..., expected_layout: _Optional[_Union[KVLayoutSpec, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ..., max_blocks_per_chunk: _Optional[int] = ..., prefix_wait_ms: _Optional[int] = ...) -> None: ...

class BlockPiece(_message.Message):
    __slots__ = ("index", "block_hash", "num_tokens", "offset", "data", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    block_hash: bytes
    num_tokens: int
    offset: int
    data: bytes
    checksum: int
    def __init__(self, index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("seq", "total_blocks", "total_tokens", "block_nbytes", "pieces")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    total_blocks: int
    total_tokens: int
    block_nbytes: int
    pieces: _containers.RepeatedCompositeFieldContainer[BlockPiece]
    def __init__(self, seq: _Optional[int] = ..., total_blocks: _Optional[int] = ..., total_tokens: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[BlockPiece, _Mapping]]] = ...) -> None: ...

class PullShmRequest(_message.Message):
    __slots__ = ("pull", "host_id")
    PULL_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    host_id: str
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., host_id: _Optional[str] = ...) -> None: ...

class ShmBlock(_message.Message):
    __slots__ = ("index", "block_hash", "num_tokens", "offset", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    block_hash: bytes
    num_tokens: int
    offset: int
    checksum: int
    def __init__(self, index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., offset: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PullShmResponse(_message.Message):
    __slots__ = ("refused", "ticket", "ticket_ttl_ms", "region_bytes", "block_nbytes", "total_tokens", "blocks")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    refused: str
    ticket: bytes
    ticket_ttl_ms: int
    region_bytes: int
    block_nbytes: int
    total_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[ShmBlock]
    def __init__(self, refused: _Optional[str] = ..., ticket: _Optional[bytes] = ..., ticket_ttl_ms: _Optional[int] = ..., region_bytes: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., total_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[ShmBlock, _Mapping]]] = ...) -> None: ...

class AttachRegionRequest(_message.Message):
    __slots__ = ("host_id", "region_bytes")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    region_bytes: int
    def __init__(self, host_id: _Optional[str] = ..., region_bytes: _Optional[int] = ...) -> None: ...

class AttachRegionResponse(_message.Message):
    __slots__ = ("refused", "ticket", "ticket_ttl_ms")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    refused: str
    ticket: bytes
    ticket_ttl_ms: int
    def __init__(self, refused: _Optional[str] = ..., ticket: _Optional[bytes] = ..., ticket_ttl_ms: _Optional[int] = ...) -> None: ...

class PullRegionRequest(_message.Message):
    __slots__ = ("pull", "host_id", "region_id", "slot_bytes")
    PULL_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    host_id: str
    region_id: bytes
    slot_bytes: int
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., host_id: _Optional[str] = ..., region_id: _Optional[bytes] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class RegionBlock(_message.Message):
    __slots__ = ("index", "block_hash", "num_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    block_hash: bytes
    num_tokens: int
    def __init__(self, index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PullRegionResponse(_message.Message):
    __slots__ = ("refused", "ticket", "ticket_ttl_ms", "block_nbytes", "total_tokens", "blocks")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    refused: str
    ticket: bytes
    ticket_ttl_ms: int
    block_nbytes: int
    total_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[RegionBlock]
    def __init__(self, refused: _Optional[str] = ..., ticket: _Optional[bytes] = ..., ticket_ttl_ms: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., total_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[RegionBlock, _Mapping]]] = ...) -> None: ...

class PullNixlRequest(_message.Message):
    __slots__ = ("pull", "skip_blocks", "num_blocks", "agent_metadata", "region_addr", "region_bytes", "notif_tag")
    PULL_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGION_ADDR_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTIF_TAG_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    skip_blocks: int
    num_blocks: int
    agent_metadata: bytes
    region_addr: int
    region_bytes: int
    notif_tag: bytes
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., skip_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., agent_metadata: _Optional[bytes] = ..., region_addr: _Optional[int] = ..., region_bytes: _Optional[int] = ..., notif_tag: _Optional[bytes] = ...) -> None: ...

class NixlBlock(_message.Message):
    __slots__ = ("index", "block_hash", "num_tokens", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    block_hash: bytes
    num_tokens: int
    checksum: int
    def __init__(self, index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PullNixlResponse(_message.Message):
    __slots__ = ("refused", "total_blocks", "total_tokens", "block_nbytes", "blocks")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    refused: str
    total_blocks: int
    total_tokens: int
    block_nbytes: int
    blocks: _containers.RepeatedCompositeFieldContainer[NixlBlock]
    def __init__(self, refused: _Optional[str] = ..., total_blocks: _Optional[int] = ..., total_tokens: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[NixlBlock, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
