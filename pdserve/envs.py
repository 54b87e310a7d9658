"""Every environment variable pdserve reads, read here and nowhere else.

Each is read when a config default is built (not at import), so a test or a launcher may set
it first. Configuration files and command-line flags override them.
"""

from __future__ import annotations

import os


def hash_seed() -> str:
    """Cluster hash seed (``PDSERVE_HASH_SEED``, default ``"0"``)."""
    return os.environ.get("PDSERVE_HASH_SEED", "0")


def device() -> str | None:
    """Forced device (``PDSERVE_DEVICE``: ``cpu`` or ``cuda``); None picks CUDA when present."""
    return os.environ.get("PDSERVE_DEVICE") or None


def redis_url() -> str | None:
    """External Redis (``PDSERVE_REDIS_URL``); None starts the embedded server."""
    return os.environ.get("PDSERVE_REDIS_URL") or None


def redis_namespace() -> str:
    """Key prefix of the Redis block index (``PDSERVE_REDIS_NAMESPACE``, default ``pdserve``)."""
    return os.environ.get("PDSERVE_REDIS_NAMESPACE", "pdserve")


def cluster_secret() -> str | None:
    """Shared secret of the KV-transfer plane (``PDSERVE_CLUSTER_SECRET``); None: ``pdserve up``
    generates one for the workers it starts."""
    return os.environ.get("PDSERVE_CLUSTER_SECRET") or None


def api_key() -> str | None:
    """The key clients of the router's APIs must present (``PDSERVE_API_KEY``; HTTP
    ``Authorization: Bearer KEY``, gRPC metadata ``authorization: Bearer KEY``); None: open.
    ``pdserve generate --router`` sends it too. Never logged."""
    return os.environ.get("PDSERVE_API_KEY") or None


def state_dir() -> str:
    """Where ``pdserve up`` leaves what other commands on this machine need (``PDSERVE_STATE_DIR``,
    default ``~/.pdserve``): the running service's addresses and the embedded Redis URL."""
    return os.environ.get("PDSERVE_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".pdserve")


def runtime_dir() -> str | None:
    """The user's private runtime directory (``XDG_RUNTIME_DIR``, e.g. ``/run/user/<uid>``): where a
    worker puts the directory of its KV transfer's Unix socket unless ``transfer.shm_dir`` says."""
    return os.environ.get("XDG_RUNTIME_DIR") or None


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels in its CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def malloc_tuning() -> bool:
    """``PDSERVE_MALLOC_TUNING`` (default on; ``0`` turns it off): workers raise glibc's malloc
    thresholds so the KV wire's chunk buffers stay resident (``kvtransfer/allocator.py``)."""
    return os.environ.get("PDSERVE_MALLOC_TUNING", "1") != "0"


def hf_hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (``1``/``true``/``yes``/``on``, as huggingface_hub reads it): a Hub id
    given as a model is looked up in the local Hub cache only, never downloaded."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cpu_bf16() -> bool | None:
    """``PDSERVE_CPU_BF16``: whether the CPU counts as having bfloat16 matrix units (AMX-BF16 or
    AVX512-BF16) when ``dtype`` is auto (``engine/model/dtype.py``). ``1``: yes, ``0``: no; unset
    or ``auto``: detected (``engine/cpu_features.py``). Any other value is a ValueError."""
    value = os.environ.get("PDSERVE_CPU_BF16", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"PDSERVE_CPU_BF16 must be 0, 1 or auto, got {value!r}")


def host_id() -> str | None:
    """``PDSERVE_HOST_ID``: this host's identity for the same-host KV transport in place of the
    kernel's boot id (``kvtransfer/shm.py``); a simulated cluster sets one per node."""
    return os.environ.get("PDSERVE_HOST_ID") or None


def cpu_kernels() -> bool:
    """``PDSERVE_CPU_KERNELS``: whether the CPU path may build and use its compiled kernels
    (``engine/kernels/cpu_build.py``: decode attention that reads K/V in place). ``0`` turns them off
    (the torch path gathers K/V instead: what a machine without a C compiler runs); unset or ``1``: on.
    Any other value is a ValueError."""
    value = os.environ.get("PDSERVE_CPU_KERNELS", "1").strip()
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"PDSERVE_CPU_KERNELS must be 0 or 1, got {value!r}")


def cpu_fp32_gemm() -> str:
    """``PDSERVE_CPU_FP32_GEMM``: the default of ``EngineConfig.cpu_fp32_gemm`` (``auto``, ``kernel`` or
    ``torch``: which product float32 projections run on the CPU, ``engine/model/gemm_paths.py``);
    unset: ``auto``. Validated by the config."""
    return os.environ.get("PDSERVE_CPU_FP32_GEMM", "auto").strip() or "auto"


def kernel_cache_dir() -> str:
    """Where compiled CPU kernels are kept between processes (``PDSERVE_KERNEL_CACHE``, default
    ``$XDG_CACHE_HOME/pdserve/kernels`` or ``~/.cache/pdserve/kernels``)."""
    explicit = os.environ.get("PDSERVE_KERNEL_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve", "kernels")


def c_compiler() -> str | None:
    """``CC``: the C compiler that builds the CPU kernels (default: ``cc`` or ``gcc`` on the PATH)."""
    return os.environ.get("CC") or None
