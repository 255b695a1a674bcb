"""The on-disk compile cache (hfpaged/model/compile_cache.py): keys, file checks, chunk merging, and a second
process that finds its graphs in the cache (slow: two processes compile on the CPU)."""

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import make_model

from hfpaged import EngineConfig
from hfpaged.model import compile_cache
from hfpaged.model.compile_cache import MAGIC, CompileCache, cache_key

CPU = torch.device("cpu")
OPTIONS = {"block_size": 4, "max_seqlen_k": 512, "kv_cache_dtype": "auto", "fuse_projections": False}


def test_key_follows_config_dtype_options_and_versions(monkeypatch):
    key, fields = cache_key(make_model("llama"), CPU, OPTIONS)
    assert cache_key(make_model("llama", seed=1), CPU, OPTIONS)[0] == key  # weights do not matter
    assert fields["config"]["num_hidden_layers"] == 2 and fields["dtypes"] == ["torch.float32"]
    assert cache_key(make_model("llama", num_hidden_layers=3), CPU, OPTIONS)[0] != key
    assert cache_key(make_model("llama", dtype=torch.bfloat16), CPU, OPTIONS)[0] != key
    assert cache_key(make_model("llama"), CPU, {**OPTIONS, "block_size": 8})[0] != key
    assert cache_key(make_model("qwen3"), CPU, OPTIONS)[0] != key
    versions = compile_cache._versions()
    monkeypatch.setattr(compile_cache, "_versions", lambda: {**versions, "torch": "0.0"})
    assert cache_key(make_model("llama"), CPU, OPTIONS)[0] != key


def test_directory_option(tmp_path):
    model = make_model("llama")
    assert CompileCache.for_model(model, CPU, "", OPTIONS) is None  # "": off
    cache = CompileCache.for_model(model, CPU, str(tmp_path), OPTIONS)
    assert cache.file == os.path.join(tmp_path, cache.key, "artifacts.bin")
    default = CompileCache.for_model(model, CPU, None, OPTIONS)
    assert default.path.startswith(os.path.join(os.path.expanduser("~"), ".cache", "hfpaged", "compile"))
    assert EngineConfig(compile_cache_dir=str(tmp_path)).compile_cache_dir == str(tmp_path)
    with pytest.raises(ValueError):
        EngineConfig(compile_cache_dir=1)


class FakeTorchCache:
    """torch.compiler's save/load_cache_artifacts: payloads are JSON lists of artifact keys."""

    def __init__(self):
        self.recorded: list[str] = []  # what this "process" compiled or hit
        self.loaded: list[list[str]] = []

    def save(self):
        if not self.recorded:
            return None
        return json.dumps(self.recorded).encode(), SimpleNamespace(artifacts={"inductor": list(self.recorded)})

    def load(self, payload):
        try:
            keys = json.loads(payload)
        except ValueError:
            return None  # what torch does with bytes it cannot unpickle
        self.loaded.append(keys)
        return SimpleNamespace(artifacts={"inductor": keys})


@pytest.fixture
def fake_torch(monkeypatch):
    fake = FakeTorchCache()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load)
    monkeypatch.setattr(compile_cache, "_loaded", set())
    monkeypatch.setattr(compile_cache, "_num_graphs_compiled", lambda: None)
    return fake


def new_process(monkeypatch, fake):
    """A fresh process: nothing recorded, nothing loaded yet."""
    fake.recorded, fake.loaded = [], []
    monkeypatch.setattr(compile_cache, "_loaded", set())


def test_save_load_and_merge(tmp_path, fake_torch, monkeypatch):
    key, fields = cache_key(make_model("llama"), CPU, OPTIONS)
    first = CompileCache(str(tmp_path), key, fields)
    assert not first.load() and not first.save()  # no file, nothing compiled
    fake_torch.recorded = ["a", "b"]
    assert first.save() and not first.save()  # the second save has nothing new
    assert json.loads(Path(first.path, "key.json").read_text())["options"] == OPTIONS

    new_process(monkeypatch, fake_torch)
    second = CompileCache(str(tmp_path), key, fields)
    assert second.load() and fake_torch.loaded == [["a", "b"]]
    assert not second.load()  # once per process
    fake_torch.recorded = ["a", "c"]  # hit one graph, compiled another
    assert second.save()

    new_process(monkeypatch, fake_torch)
    third = CompileCache(str(tmp_path), key, fields)
    assert third.load()
    assert sorted(fake_torch.loaded) == [["a", "b"], ["a", "c"]]  # b, which the second did not use, stayed
    assert third.known == {"inductor:a", "inductor:b", "inductor:c"}
    fake_torch.recorded = ["a", "b", "c"]
    assert not third.save()  # nothing the file lacks
    fake_torch.recorded = ["a", "b", "c", "d"]
    assert third.save()  # covers both chunks: one chunk left
    header = Path(third.file).read_bytes().split(b"\n")[1]
    assert len(json.loads(header)["chunks"]) == 1


def corrupt_variants(good: bytes, key: str) -> dict[str, bytes]:
    magic, header, payload = good.split(b"\n", 2)
    other_key = json.dumps({**json.loads(header), "key": "0" * len(key)}).encode()
    unreadable = json.loads(header)
    unreadable["chunks"][0]["size"] = 3
    unreadable["chunks"][0]["sha256"] = hashlib.sha256(b"???").hexdigest()
    return {
        "empty": b"",
        "not ours": b"PK\x03\x04 some zip",
        "other key": b"\n".join([magic, other_key, payload]),
        "truncated": good[:-3],
        "flipped byte": good[:-2] + bytes([good[-2] ^ 1]) + good[-1:],
        "trailing bytes": good + b"x",
        "bad header": magic + b"\n{not json\n" + payload,
        "torch cannot read it": b"\n".join([magic, json.dumps(unreadable).encode(), b"???"]),
    }


def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(tmp_path, fake_torch, monkeypatch, caplog):
    key, fields = cache_key(make_model("llama"), CPU, OPTIONS)
    writer = CompileCache(str(tmp_path), key, fields)
    fake_torch.recorded = ["a"]
    assert writer.save()
    good = Path(writer.file).read_bytes()
    assert good.startswith(MAGIC)
    for name, data in corrupt_variants(good, key).items():
        new_process(monkeypatch, fake_torch)
        with open(writer.file, "wb") as f:
            f.write(data)
        caplog.clear()
        reader = CompileCache(str(tmp_path), key, fields)
        with caplog.at_level(logging.WARNING, logger="hfpaged"):
            assert not reader.load(), name
        assert "ignoring the compile cache" in caplog.text, name
        assert fake_torch.loaded == [] or name == "torch cannot read it", name
        fake_torch.recorded = ["a"]
        assert reader.save(), name  # the next save replaces the bad file
    new_process(monkeypatch, fake_torch)
    assert CompileCache(str(tmp_path), key, fields).load()


def test_a_key_mismatch_is_a_miss(tmp_path, fake_torch, monkeypatch):
    key, fields = cache_key(make_model("llama"), CPU, OPTIONS)
    fake_torch.recorded = ["a"]
    assert CompileCache(str(tmp_path), key, fields).save()
    new_process(monkeypatch, fake_torch)
    other_key, other_fields = cache_key(make_model("llama", num_hidden_layers=3), CPU, OPTIONS)
    assert not CompileCache(str(tmp_path), other_key, other_fields).load()
    assert fake_torch.loaded == []


def test_an_unwritable_directory_does_not_fail_the_step(tmp_path, fake_torch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    key, fields = cache_key(make_model("llama"), CPU, OPTIONS)
    fake_torch.recorded = ["a"]
    with caplog.at_level(logging.WARNING, logger="hfpaged"):
        assert not CompileCache(str(blocker), key, fields).save()
    assert "could not write the compile cache" in caplog.text


CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from models import make_model, random_prompts
from test_compiled import compiled_decode
from torch._dynamo.utils import counters
model = make_model("llama", num_hidden_layers=4)
generated, _ = compiled_decode(model, random_prompts([5, 9, 3], seed=1), max_new_tokens=3, compile_cache_dir={cache!r})
print("RESULT " + json.dumps({{"generated": generated, "inductor": dict(counters["inductor"])}}))
"""


@pytest.mark.slow
def test_a_second_process_finds_its_graphs_in_the_cache(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = CHILD.format(tests=tests, cache=str(tmp_path / "hfpaged"))
    results = []
    for run in range(2):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor{run}"), TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-3000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    cold, warm = results
    assert cold["inductor"].get("fxgraph_cache_miss", 0) > 0
    # a fresh inductor cache directory: every graph came from the hfpaged cache
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0 and warm["inductor"].get("fxgraph_cache_hit", 0) > 0
    assert warm["generated"] == cold["generated"]
