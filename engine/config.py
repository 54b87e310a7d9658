"""Frozen, validated configuration of the engine's components."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve import envs

KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # engine.kernels.quant maps them
CPU_FP32_GEMM_CHOICES = ("auto", "kernel", "torch")  # engine.model.gemm_paths
# vLLM's --dtype spellings that are not the stored names: "auto" is None (the device's default).
DTYPE_ALIASES: dict[str, str | None] = {"auto": None, "half": "float16", "float": "float32"}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, how many blocks (or a memory budget), prefix caching."""

    block_size: int = 16
    # The pool's size (engine/kv_budget.py): exactly num_blocks blocks when given; else a budget of
    # kv_cache_memory_bytes (vLLM's --kv-cache-memory-bytes); else the default, on a GPU
    # gpu_memory_utilization of its memory less the model and activations, on the CPU room for one
    # request of max_model_len (at least 256 MiB). A budget that cannot hold one request of
    # max_model_len tokens is refused at start.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Root of every block-hash chain (docs/block-hashes.md); the same on every process of a cluster.
    hash_seed: str = field(default_factory=envs.hash_seed)
    # vLLM's names: "auto" (the model's dtype), "fp8" (= "fp8_e4m3") or "fp8_e5m2": KV stored in
    # one byte per value with per-layer scales (the checkpoint's k_scale/v_scale, else 1.0).
    kv_cache_dtype: str = "auto"
    # vLLM's --kv-offload-gb: host memory (GiB) for a second tier that keeps blocks the pool
    # evicts (engine/kv_offload.py); 0: none. Needs enable_prefix_caching: blocks are kept and found
    # by their prefix hash. Allocated at start: a size the host cannot give is refused then.
    kv_offload_gb: float = 0.0
    # A disk tier behind the host tier (GiB of local disk per engine): blocks the host tier drops
    # for room are written there instead of lost. Needs kv_offload_gb > 0. The file is unnamed and
    # owner-only, in kv_offload_disk_dir (None: the system's temporary directory).
    kv_offload_disk_gb: float = 0.0
    kv_offload_disk_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("kv_offload_gb", "kv_offload_disk_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.kv_offload_disk_gb > 0 and self.kv_offload_gb <= 0:
            raise ValueError("kv_offload_disk_gb needs kv_offload_gb > 0: the disk tier takes what the host tier drops")
        if self.kv_offload_gb > 0 and not self.enable_prefix_caching:
            # Without prefix caching no block has a hash: the tier would reserve its memory (and
            # disk) and never keep or restore a block.
            raise ValueError("kv_offload_gb needs enable_prefix_caching=True: the offload tier keeps and finds blocks "
                             "by their prefix hash")  # fmt: skip
        if self.kv_offload_disk_dir is not None and (not isinstance(self.kv_offload_disk_dir, str)
                                                     or not self.kv_offload_disk_dir):  # fmt: skip
            raise ValueError(f"kv_offload_disk_dir must be a directory path, got {self.kv_offload_disk_dir!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, "
                             f"got {self.kv_cache_dtype!r}")  # fmt: skip
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        if not isinstance(self.hash_seed, str):
            raise ValueError(f"hash_seed must be a string, got {self.hash_seed!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism inside one worker (engine/parallel/): ``tensor_parallel_size`` ranks, each
    holding 1/N of every layer's heads and MLP columns, stepped together from the driver's plan.

    ``collective_timeout_s``: how long one step's collective waits for a rank before the step fails
    (a rank that died fails it at once: its sockets close). ``start_timeout_s``: how long the
    driver waits for every rank to load its shard and report ready.

    ``distributed_executor_backend`` (vLLM's name): where ranks 1..N-1 run. ``"mp"``: child
    processes of the engine's process (an engine of its own: ``LLM``, benchmarks). ``"ray"``: Ray
    actors in the bundles of the placement group the engine's own actor runs in (a served worker;
    ``pdserve up`` sets it).
    """

    tensor_parallel_size: int = 1
    collective_timeout_s: float = 60.0
    start_timeout_s: float = 600.0
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 64:
            raise ValueError(f"tensor_parallel_size must be an integer in [1, 64], got {tp!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")  # fmt: skip
        for name in ("collective_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine instance loads and how it runs.

    ``model``: a checkpoint directory (None only in a template that is completed later, e.g.
    a service config whose model is chosen at start; an engine refuses it).
    """

    model: str | None = None
    # "float32" | "bfloat16" | "float16"; None (auto): bfloat16 on CUDA; on the CPU bfloat16 for a
    # checkpoint stored in bfloat16/float16 (or a GGUF file with tensors other than F32) where the CPU
    # has AMX-BF16 or AVX512-BF16, else float32 (engine/model/dtype.py has the rule). vLLM's spellings
    # are accepted and stored in these words: "auto" (None), "half" (float16), "float" (float32).
    dtype: str | None = None
    device: str | None = field(default_factory=envs.device)  # None: CUDA if available, else CPU
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # CPU float32 and bfloat16: projections run through a packed copy of their weights
    # (engine/model/linear.py): float32 through the panel kernel (engine/kernels/cpu_gemm.c) where it
    # is built, else oneDNN on 8+ rows; bfloat16 through the AMX tile kernel (engine/kernels/cpu_amx.c)
    # where the CPU has AMX-BF16 and a layer's inputs are a multiple of 32, else oneDNN, on every row
    # count. Costs a second copy of the linear weights; False keeps torch's products everywhere.
    cpu_onednn: bool = True
    # CPU float32 with cpu_onednn: which product each projection runs (engine/model/gemm_paths.py).
    # "auto": the packed copy and torch's product are timed per weight shape and row count when the
    # model loads, and the faster taken; "kernel": the packed copy at every row count; "torch": torch's
    # products only (no float32 copy is built). Default from PDSERVE_CPU_FP32_GEMM, else "auto".
    cpu_fp32_gemm: str = field(default_factory=envs.cpu_fp32_gemm)
    # vLLM's --disable-cascade-attn: on the CPU's torch path, decodes that share prefix blocks read
    # them once together (engine/kernels/cascade.py) unless this is set.
    disable_cascade_attn: bool = False
    # vLLM's --revision / --download-dir: which revision of a Hugging Face Hub id ``model`` names
    # (a branch, tag or commit; None: "main") and the Hub cache to use (None: $HF_HOME/hub).
    # Read where the id is resolved to a local directory (engine/model/hub.py); a local path
    # ignores them.
    revision: str | None = None
    download_dir: str | None = None
    # vLLM's --chat-template: the Jinja template text that replaces the checkpoint's (``pdserve up``
    # reads a file path given there into its text, so every process gets the template, not a path).
    chat_template: str | None = None
    # vLLM's --seed: the seed of the engine's random generator, set when the engine starts, which
    # requests without a seed of their own sample from (a request's ``seed`` keeps its own
    # generator). None: not seeded. (vLLM's default is 0.)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a non-empty path, got {self.model!r}")
        if isinstance(self.dtype, str) and self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        for name in ("revision", "download_dir", "chat_template"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):  # fmt: skip
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("cpu_onednn", "disable_cascade_attn"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cpu_fp32_gemm not in CPU_FP32_GEMM_CHOICES:
            raise ValueError(f"cpu_fp32_gemm must be one of {', '.join(CPU_FP32_GEMM_CHOICES)}, got {self.cpu_fp32_gemm!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16 (or half, float), got {self.dtype!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
