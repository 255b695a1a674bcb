"""An on-disk cache of torch.compile artifacts, keyed by model config, dtype, device and library versions.

``patch(..., compile=True)`` loads ``<dir>/<key>/artifacts.bin`` before the first compile and writes it after
each forward that compiled something new (the decode graphs' warm-up, outside any capture), so a second
process skips inductor's codegen and Triton's compiles: dynamo still traces (one layer, seconds), then every
graph is a cache hit. ``<dir>`` is ``EngineConfig.compile_cache_dir`` (None: ``~/.cache/hfpaged/compile``;
``""``: off). The artifacts are PyTorch's mega-cache (``torch.compiler.save_cache_artifacts``: inductor's
FX-graph and AOTAutograd cache entries with the Triton kernels inductor generated, bundled); loading hands
them to inductor's own caches, whose entries are looked up by a hash of the graph, inductor's config and the
versions, so the key here only chooses which file to read: a stale or foreign file can cost a miss, never a
wrong kernel. A file that does not carry its own key, or whose checksum fails, or that torch cannot read is
ignored with a warning (and rewritten at the next save). Without the mega-cache API (torch < 2.7) inductor's
cache directory is pointed at ``<dir>/<key>/inductor`` instead, unless the user set one.

The hfpaged Triton kernels (attention, store_kv) are not in these artifacts: Triton keeps them in its own
on-disk cache (``~/.triton/cache``), keyed by source, options and device.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import sys

import torch

logger = logging.getLogger("hfpaged")

MAGIC = b"hfpaged-compile-cache 1\n"
FILE_NAME = "artifacts.bin"
_loaded: set[str] = set()  # files already loaded in this process


def default_dir() -> str:
    """``~/.cache/hfpaged/compile``."""
    return os.path.join(os.path.expanduser("~"), ".cache", "hfpaged", "compile")


def _versions() -> dict[str, str | None]:
    import transformers

    try:
        hfpaged_version = importlib.metadata.version("hfpaged")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        hfpaged_version = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "hfpaged": hfpaged_version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda {torch.cuda.get_device_name(device)} sm{major}{minor} cuda {torch.version.cuda}"
    return f"{device.type} {platform.machine()}"


def cache_key(model: torch.nn.Module, device: torch.device, options: dict) -> tuple[str, dict]:
    """(hex key, the fields it hashes): the model's class and config (``to_dict``, keys sorted), its parameter
    dtypes, the device, the library versions and the engine ``options`` that shape the compiled graphs."""
    fields = {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": model.config.to_dict(),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "device": _device_name(device),
        "versions": _versions(),
        "options": options,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32], json.loads(text)


class CompileCache:
    """The artifacts file of one key: ``load`` before compiling, ``save`` after.

    The file holds one or more chunks, each a ``save_cache_artifacts`` payload: a process that loads the file
    and then compiles something new writes its own payload (everything it compiled or hit) plus the loaded
    chunks it did not cover, so graphs another process compiled (other buckets, other layers) stay.
    """

    def __init__(self, root: str, key: str, fields: dict):
        self.path = os.path.join(root, key)
        self.file = os.path.join(self.path, FILE_NAME)
        self.key = key
        self.fields = fields
        self.chunks: list[tuple[bytes, set[str]]] = []  # loaded from the file, with their artifact keys
        self.known: set[str] = set()  # artifact keys the file holds (loaded or saved)
        self.mega_cache = hasattr(torch.compiler, "save_cache_artifacts")
        self.num_graphs: int | None = None  # dynamo's count of graphs compiled in this process at the last save

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, device: torch.device, directory: str | None, options: dict
    ) -> CompileCache | None:
        """The cache of ``model`` under ``directory`` (None: the default; ``""``: None, no cache)."""
        if directory == "":
            return None
        key, fields = cache_key(model, device, options)
        return cls(os.path.expanduser(directory) if directory else default_dir(), key, fields)

    def load(self) -> bool:
        """Hand the saved artifacts to torch's caches (once per process and file); True when some were loaded."""
        if not self.mega_cache:
            self._point_inductor_here()
            return False
        if self.file in _loaded or not os.path.exists(self.file):
            return False
        _loaded.add(self.file)
        try:
            chunks = self._read()
            for payload, _ in chunks:
                if torch.compiler.load_cache_artifacts(payload) is None:
                    raise ValueError("torch could not read the artifacts")
        except Exception as error:  # a truncated, corrupt or foreign file: compile from scratch
            logger.warning("hfpaged: ignoring the compile cache %s (%s: %s)", self.file, type(error).__name__, error)
            return False
        self.chunks = chunks
        self.known = set().union(*(keys for _, keys in chunks))
        logger.info("hfpaged: loaded %d compile artifacts from %s", len(self.known), self.file)
        return bool(self.known)

    def _read(self) -> list[tuple[bytes, set[str]]]:
        with open(self.file, "rb") as f:
            if f.readline() != MAGIC:
                raise ValueError("not an hfpaged compile cache file")
            header = json.loads(f.readline())
            if header.get("key") != self.key:
                raise ValueError(f"written for key {header.get('key')}, not {self.key}")
            chunks = []
            for chunk in header["chunks"]:
                payload = f.read(chunk["size"])
                if len(payload) != chunk["size"] or hashlib.sha256(payload).hexdigest() != chunk["sha256"]:
                    raise ValueError("checksum mismatch")
                chunks.append((payload, set(chunk["artifacts"])))
            if f.read(1):
                raise ValueError("trailing bytes")
        return chunks

    def save(self) -> bool:
        """Write every artifact this process compiled or hit, if one is not in the file yet; True when written."""
        if not self.mega_cache:
            return False
        graphs = _num_graphs_compiled()
        if graphs is not None and graphs == self.num_graphs:
            return False  # nothing was compiled (or looked up) since the last save
        self.num_graphs = graphs
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return False
            payload, info = saved
            keys = _artifact_keys(info)
            if not keys or keys <= self.known:
                return False
            chunks = [(payload, keys)] + [(p, k) for p, k in self.chunks if not k <= keys]
            header = {
                "key": self.key,
                "chunks": [
                    {"size": len(p), "sha256": hashlib.sha256(p).hexdigest(), "artifacts": sorted(k)} for p, k in chunks
                ],
            }
            os.makedirs(self.path, exist_ok=True)
            temporary = f"{self.file}.{os.getpid()}.tmp"
            with open(temporary, "wb") as f:
                f.write(MAGIC + json.dumps(header).encode() + b"\n")
                for p, _ in chunks:
                    f.write(p)
            os.replace(temporary, self.file)  # readers see the old file or the new one, never half of one
            with open(os.path.join(self.path, "key.json"), "w") as f:
                json.dump(self.fields, f, indent=1, sort_keys=True)
        except Exception as error:  # a full disk or a read-only home must not fail a step
            logger.warning("hfpaged: could not write the compile cache %s (%s)", self.file, error)
            return False
        self.chunks = chunks
        self.known = set().union(*(k for _, k in chunks))
        logger.info("hfpaged: saved %d compile artifacts to %s", len(self.known), self.file)
        return True

    def _point_inductor_here(self) -> None:
        """torch < 2.7: inductor's own on-disk cache under this key, unless the user chose a directory."""
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            os.makedirs(self.path, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(self.path, "inductor")


def _num_graphs_compiled() -> int | None:
    """How many graphs dynamo compiled in this process (None where the counter is not there)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["stats"]["unique_graphs"]


def _artifact_keys(info) -> set[str]:
    """The artifact keys a ``CacheInfo`` lists."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {f"{kind}:{key}" for kind, keys in artifacts.items() for key in keys}
