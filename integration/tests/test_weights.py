"""The weights identity: other weights never share KV, copies of the same weights do."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import attention, groups, model_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import RequestHashes
from hybridkv.integration.weights import (
    SAMPLE_BYTES,
    TENSOR_SAMPLES_PER_FILE,
    WeightsFormatError,
    weights_fingerprint,
    weights_identity,
)

SHAPE = ModelShape(tp_size=1, total_kv_heads=2)


def save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format written by hand: an 8-byte header length, a JSON header of
    names, dtypes, shapes and data offsets, then the tensors' bytes back to back."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": {"float32": "F32", "float16": "F16"}[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for array in tensors.values():
            file.write(np.ascontiguousarray(array).tobytes())


def checkpoint(directory: Path, seed: int = 0, shards: int = 2, config: str = "{}") -> Path:
    """A checkpoint as `save_pretrained` leaves it: safetensors shards, config, tokenizer."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        tensors = {
            f"model.layers.{shard}.{name}": rng.standard_normal(shape).astype(np.float32)
            for name, shape in (("q.weight", (16, 8)), ("k.weight", (8, 8)), ("norm", (8,)))
        }
        save_safetensors(directory / f"model-{shard:05d}-of-{shards:05d}.safetensors", tensors)
    (directory / "config.json").write_text(config)
    (directory / "tokenizer.json").write_text('{"vocab": {}}')
    return directory


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        value = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([value ^ 0x01]))


def tensor_spans(path: Path) -> list[tuple[int, int]]:
    """Each tensor's [begin, end) in the file, by offset."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    return sorted(
        (8 + length + entry["data_offsets"][0], 8 + length + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    )


def test_a_copy_in_another_directory_has_the_same_fingerprint(tmp_path: Path) -> None:
    original = checkpoint(tmp_path / "run1" / "hf")
    copy = tmp_path / "mirror" / "hf"
    shutil.copytree(original, copy)
    os.utime(copy / "config.json", (0, 0))  # copies need not keep times
    assert weights_fingerprint(original) == weights_fingerprint(copy)


def test_other_weights_under_the_same_directory_name_have_another_fingerprint(
    tmp_path: Path,
) -> None:
    run1 = checkpoint(tmp_path / "run1" / "hf", seed=1)
    run2 = checkpoint(tmp_path / "run2" / "hf", seed=2)
    assert weights_fingerprint(run1) != weights_fingerprint(run2)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_byte_the_samples_cover_changes_the_fingerprint(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Oracle: with no more tensors in a shard than the samples per file, the middle
    SAMPLE_BYTES of every tensor are read; a byte changed there changes the digest."""
    directory = checkpoint(tmp_path_factory.mktemp("ckpt"), seed=data.draw(st.integers(0, 9)))
    shard = data.draw(st.sampled_from(sorted(directory.glob("*.safetensors"))))
    spans = tensor_spans(shard)
    assert len(spans) <= TENSOR_SAMPLES_PER_FILE
    begin, end = data.draw(st.sampled_from(spans))
    covered = min(SAMPLE_BYTES, end - begin)
    start = begin + max(0, (end - begin - SAMPLE_BYTES) // 2)
    offset = data.draw(st.integers(start, start + covered - 1))
    before = weights_fingerprint(directory)
    flip_byte(shard, offset)
    assert weights_fingerprint(directory) != before


def test_a_changed_header_or_config_changes_the_fingerprint(tmp_path: Path) -> None:
    directory = checkpoint(tmp_path / "hf")
    before = weights_fingerprint(directory)
    (directory / "config.json").write_text('{"rope_theta": 5e5}')
    after_config = weights_fingerprint(directory)
    assert after_config != before
    shard = sorted(directory.glob("*.safetensors"))[0]
    flip_byte(shard, shard.read_bytes().index(b"q.weight"))  # a tensor's name: p.weight
    assert weights_fingerprint(directory) not in (before, after_config)


def test_files_vllm_does_not_load_leave_the_fingerprint_alone(tmp_path: Path) -> None:
    """Tokenizer files, and .bin files beside safetensors (vLLM loads the safetensors)."""
    directory = checkpoint(tmp_path / "hf")
    before = weights_fingerprint(directory)
    (directory / "tokenizer.json").write_text('{"vocab": {"a": 1}}')
    (directory / "training_args.bin").write_bytes(b"\x00" * 100)
    assert weights_fingerprint(directory) == before


def test_pickled_weights_are_sampled_across_the_file(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    directory.mkdir()
    weights = directory / "pytorch_model.bin"
    weights.write_bytes(bytes(range(256)) * 4096)
    before = weights_fingerprint(directory)
    assert before is not None
    flip_byte(weights, weights.stat().st_size - 1)  # the last sample ends at the file's end
    assert weights_fingerprint(directory) != before


def test_a_directory_without_weight_files_has_no_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert weights_fingerprint(tmp_path) is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"\x01\x00", "too short"),
        ((1 << 40).to_bytes(8, "little"), "header of"),
        ((100).to_bytes(8, "little") + b"{}", "cut short"),
        ((2).to_bytes(8, "little") + b"[]", "unreadable"),
    ],
)
def test_a_damaged_safetensors_file_is_named(tmp_path: Path, content: bytes, problem: str) -> None:
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(WeightsFormatError, match=f"model.safetensors.*{problem}"):
        weights_fingerprint(tmp_path)


def test_a_rewritten_file_is_read_again(tmp_path: Path) -> None:
    """The fingerprint is cached per process, by each file's size, time and inode."""
    directory = checkpoint(tmp_path / "hf", seed=1)
    before = weights_fingerprint(directory)
    time.sleep(0.01)
    checkpoint(directory, seed=2)  # same sizes, other bytes, written in place
    assert weights_fingerprint(directory) != before


def vllm_config(model: str, *, draft: str | None = None, **fields: Any) -> Any:
    def model_fields(name: str) -> Any:
        return model_config(model=name, **fields)

    return SimpleNamespace(
        model_config=model_fields(model),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        load_config=SimpleNamespace(load_format="auto", download_dir=None),
        speculative_config=(
            None if draft is None else SimpleNamespace(draft_model_config=model_fields(draft))
        ),
    )


def test_weights_that_compute_other_kv_hash_every_block_apart(
    vllm_specs: Any, tmp_path: Path
) -> None:
    """One model name and cache layout, other weights (other files under the same
    directory name, an explicit weights_version, a revision, a quantization, a dtype, RoPE
    overrides, another draft model): no block hash in common, so neither loads the
    other's KV. A byte copy of the same checkpoint shares every block."""
    import torch

    run1 = str(checkpoint(tmp_path / "run1" / "hf", seed=1))
    run2 = str(checkpoint(tmp_path / "run2" / "hf", seed=2))
    mirror = tmp_path / "mirror" / "hf"
    shutil.copytree(run1, mirror)
    eagle1 = str(checkpoint(tmp_path / "eagle1", seed=3))
    eagle2 = str(checkpoint(tmp_path / "eagle2", seed=4))
    identities = [
        weights_identity(vllm_config(run1)),
        weights_identity(vllm_config(run2)),
        weights_identity(vllm_config(run1), weights_version="step-2"),
        weights_identity(vllm_config(run1, revision="v2")),
        weights_identity(vllm_config(run1, quantization="fp8")),
        weights_identity(vllm_config(run1, dtype=torch.float16)),
        weights_identity(
            vllm_config(run1, hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 2}})
        ),
        weights_identity(vllm_config(run1, draft=eagle1)),
        weights_identity(vllm_config(run1, draft=eagle2)),
    ]
    assert len(set(identities)) == len(identities)
    assert weights_identity(vllm_config(str(mirror))) == identities[0]  # a copy elsewhere
    specs = groups(vllm_specs, (["a"], attention(vllm_specs)))
    tokens = list(range(64))
    hashes = []
    for identity in [*identities, identities[0]]:
        request_hashes = RequestHashes(plan_groups(specs, [0], SHAPE, weights=identity), "", None)
        request_hashes.cover(tokens, 64)
        hashes.append(request_hashes.for_group(32))
    assert hashes[0] == hashes[-1]
    assert len({block for blocks in hashes for block in blocks}) == 2 * len(identities)


def test_a_hub_name_counts_in_full_and_missing_weights_are_said(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`meta-llama/X` and `my-org/X` share a last name but not their KV; a model whose
    weights are not on this host (streamed from object storage, not downloaded) is keyed
    by its full name, with a warning that weights_version must then tell weights apart."""
    monkeypatch.chdir(tmp_path)  # no directory here is named like the hub ids
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.WARNING, logger="hybridkv.integration.weights"):
        first = weights_identity(vllm_config("meta-llama/X"))
        second = weights_identity(vllm_config("my-org/X"))
        streamed = weights_identity(vllm_config("meta-llama/X", model_weights="s3://b/X"))
    assert len({first, second, streamed}) == 3
    assert json.loads(first)["weights"] == {"model": "meta-llama/X"}
    assert json.loads(streamed)["weights"] == {"model": "s3://b/X"}
    assert "no local weight files found for 'my-org/X'" in caplog.text
    assert "weights_version" in caplog.text


def test_a_downloaded_hub_model_is_fingerprinted_from_the_hub_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM keeps `model` as the hub id and reads the files from the hub cache: their
    fingerprint counts, and so does the id (two organisations, two KV sets)."""
    cache = tmp_path / "hub"
    for repo, seed in (("org-a/X", 1), ("org-b/X", 1)):
        folder = cache / f"models--{repo.replace('/', '--')}"
        checkpoint(folder / "snapshots" / "0123abcd", seed=seed)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("0123abcd")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = vllm_config("org-a/X")
    config.load_config.download_dir = str(cache)
    weights = json.loads(weights_identity(config))["weights"]
    snapshot = cache / "models--org-a--X" / "snapshots" / "0123abcd"
    assert weights == {"hub_id": "org-a/X", "fingerprint": weights_fingerprint(snapshot)}
    other = vllm_config("org-b/X")
    other.load_config.download_dir = str(cache)
    assert weights_identity(other) != weights_identity(config)
