"""What makes one prefix's KV differ between instances of one model name and cache layout.

Two checkpoints saved under one directory name, or one hub name under two organisations,
must never share KV: their weights compute other KV for the same tokens, and loading the
other's would be silently wrong output. So the identity folds in a fingerprint of the
weight files themselves, cheap enough to take at every start-up: each file's size, the
safetensors header (every tensor's name, dtype, shape and offsets) and a few bytes from
the middle of its tensors. A byte copy of a checkpoint in another directory (or on
another host) has the same fingerprint and shares KV; a fine-tune that changes a tensor
the samples miss does not change it: such deployments set `weights_version`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# vLLM loads safetensors where a checkpoint has them, else the other formats.
SAFETENSORS = ".safetensors"
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
# Files beside the weights that change the KV they compute (RoPE, norms, sizes).
CONFIG_FILES = ("config.json", "params.json")
SAMPLE_BYTES = 64
TENSOR_SAMPLES_PER_FILE = 512
OTHER_FILE_SAMPLES = 16
OTHER_SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


class WeightsFormatError(ValueError):
    """A weight file that is not what its name says (a truncated or foreign file)."""


def weights_identity(vllm_config: VllmConfig, weights_version: str = "") -> str:
    """Everything besides the layout that makes one prefix's KV differ: the weights
    (their fingerprint, or the model's hub id where no local files are found), an
    explicit `weights_version`, the checkpoint revision, quantization, compute and cache
    dtypes, the load format and config overrides (e.g. RoPE scaling); an EAGLE/MTP draft
    model's weights too, since its KV is stored beside the target's. Folded into every
    block hash."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    overrides = model.hf_overrides
    identity: dict[str, Any] = {
        "weights": _model_weights(model, vllm_config.load_config),
        "weights_version": weights_version,
        "revision": model.revision,
        "code_revision": model.code_revision,
        "quantization": model.quantization,
        "quantization_config": model.quantization_config,
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "load_format": str(vllm_config.load_config.load_format),
        "hf_overrides": (
            f"{overrides.__module__}.{overrides.__qualname__}" if callable(overrides) else overrides
        ),
    }
    speculative = vllm_config.speculative_config
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and draft.model != model.model:
        identity["draft_weights"] = _model_weights(draft, vllm_config.load_config)
    return json.dumps(identity, sort_keys=True, default=repr)


def _model_weights(model: Any, load_config: Any) -> dict[str, str]:
    """The fingerprint of a model's local weights; its name where none are found."""
    # Weights streamed from object storage: `model` is a local copy of the config only.
    name = str(model.model_weights or model.model)
    local = _local_checkpoint(name, model.revision, load_config.download_dir)
    fingerprint = None if local is None else weights_fingerprint(local)
    if fingerprint is None:
        logger.warning(
            "hybridkv: no local weight files found for %r; its KV is keyed by that name "
            "and revision only: deployments serving other weights under this name must "
            "set another weights_version",
            name,
        )
        return {"model": name}
    # A local path names nothing by itself (copies share KV); a hub id does.
    named = {} if os.path.exists(name) else {"hub_id": name}
    return {**named, "fingerprint": fingerprint}


def _local_checkpoint(name: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The directory (or single file, e.g. GGUF) holding a model's weights on this host:
    the path given, or the hub cache's snapshot of a hub id vLLM downloaded."""
    if os.path.exists(name):
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(
            name, revision=revision, cache_dir=download_dir, local_files_only=True
        )
    except Exception:  # not a hub id, or not downloaded (remote loaders, dummy weights)
        return None
    return Path(snapshot)


def weights_fingerprint(checkpoint: Path) -> str | None:
    """A digest of the checkpoint's weight and config files: names relative to the
    checkpoint, sizes, safetensors headers and sampled tensor bytes; None where it holds
    no weight file, whose digest would say nothing about the weights."""
    files = _weight_files(checkpoint)
    if not files:
        return None
    stats = tuple((str(path), *_stat_key(path)) for path in files)
    return _fingerprint(str(checkpoint), stats)


def _stat_key(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


@functools.lru_cache(maxsize=16)
def _fingerprint(checkpoint: str, stats: tuple[tuple[str, int, int, int], ...]) -> str:
    """Cached by the files' size, change time and inode: a process plans its layout more
    than once (each connector role, each TP rank), and a rewritten file is read again."""
    digest = hashlib.blake2b(digest_size=16)
    root = Path(checkpoint)
    for name, size, *_ in stats:
        path = Path(name)
        relative = path.name if path == root else str(path.relative_to(root))
        digest.update(json.dumps([relative, size]).encode())
        with path.open("rb") as file:
            for chunk in _samples(file, path, size):
                digest.update(len(chunk).to_bytes(8, "little"))
                digest.update(chunk)
    return digest.hexdigest()


def _weight_files(checkpoint: Path) -> list[Path]:
    """What vLLM would load (safetensors where there are any) plus the config files."""
    if checkpoint.is_file():
        return [checkpoint]
    entries = sorted(path for path in checkpoint.iterdir() if path.is_file())
    weights = [path for path in entries if path.suffix == SAFETENSORS]
    if not weights:
        weights = [path for path in entries if path.suffix in OTHER_WEIGHTS]
    if not weights:
        return []
    return [*weights, *(path for path in entries if path.name in CONFIG_FILES)]


def _samples(file: Any, path: Path, size: int) -> Iterator[bytes]:
    if path.suffix == SAFETENSORS:
        yield from _safetensors_samples(file, path)
    elif path.name in CONFIG_FILES:
        yield file.read()
    else:
        yield from _spread_samples(file, size)


def _safetensors_samples(file: Any, path: Path) -> Iterator[bytes]:
    """The header whole, then bytes from the middle of up to TENSOR_SAMPLES_PER_FILE
    tensors spread over the file (every tensor in most shards)."""
    prefix = file.read(8)
    if len(prefix) < 8:
        raise WeightsFormatError(f"{path} is too short to be a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise WeightsFormatError(f"{path}: a safetensors header of {length} bytes")
    header = file.read(length)
    if len(header) < length:
        raise WeightsFormatError(f"{path}: its safetensors header is cut short")
    yield header
    try:
        tensors = json.loads(header)
        spans = sorted(
            tuple(entry["data_offsets"])
            for name, entry in tensors.items()
            if name != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise WeightsFormatError(f"{path}: unreadable safetensors header ({error})") from error
    data = 8 + length
    step = max(1, len(spans) / TENSOR_SAMPLES_PER_FILE)
    for index in range(min(len(spans), TENSOR_SAMPLES_PER_FILE)):
        begin, end = spans[int(index * step)]
        middle = begin + max(0, (end - begin - SAMPLE_BYTES) // 2)
        yield os.pread(file.fileno(), min(SAMPLE_BYTES, end - begin), data + middle)


def _spread_samples(file: Any, size: int) -> Iterator[bytes]:
    """Formats whose layout hybridkv does not parse: bytes at evenly spread offsets,
    the first and the last included."""
    last = max(0, size - OTHER_SAMPLE_BYTES)
    for index in range(OTHER_FILE_SAMPLES):
        offset = last * index // (OTHER_FILE_SAMPLES - 1)
        yield os.pread(file.fileno(), OTHER_SAMPLE_BYTES, offset)
