"""The base model's sha256 kept per file (flux_trainer.sdscripts.file_hash)."""

from __future__ import annotations

import hashlib
import json
import os

from flux_trainer.sdscripts import file_hash


class Counting:
    """A stand-in for sd-scripts' calculate_sha256 that counts the files it reads."""

    def __init__(self, answer=None) -> None:
        self.read: list[str] = []
        self.answer = answer

    def __call__(self, filename: str) -> str:
        self.read.append(filename)
        if self.answer is not None:
            return self.answer
        return hashlib.sha256(open(filename, "rb").read()).hexdigest()


def test_a_file_is_read_once_and_its_digest_kept(tmp_path):
    model = tmp_path / "flux.safetensors"
    model.write_bytes(os.urandom(3000))
    compute, cache = Counting(), tmp_path / "cache" / file_hash.CACHE_FILE
    want = hashlib.sha256(model.read_bytes()).hexdigest()

    assert file_hash.cached(compute, cache)(str(model)) == want
    assert file_hash.cached(compute, cache)(str(model)) == want  # a later run: a fresh wrapper, the same cache
    assert compute.read == [str(model)]
    assert list(json.loads(cache.read_text()).values()) == [want]


def test_a_changed_file_is_read_again(tmp_path):
    model = tmp_path / "flux.safetensors"
    model.write_bytes(b"a" * 100)
    compute, cache = Counting(), tmp_path / file_hash.CACHE_FILE
    sha = file_hash.cached(compute, cache)
    first = sha(str(model))
    model.write_bytes(b"b" * 100)  # same size: the modification time tells
    os.utime(model, ns=(os.stat(model).st_atime_ns, os.stat(model).st_mtime_ns + 10**9))
    second = sha(str(model))
    model.write_bytes(b"b" * 101)
    third = sha(str(model))
    assert compute.read == [str(model)] * 3
    assert (first, second, third) == tuple(
        hashlib.sha256(c * n).hexdigest() for c, n in ((b"a", 100), (b"b", 100), (b"b", 101))
    )


def test_the_same_file_by_another_path_is_not_read_again(tmp_path):
    model = tmp_path / "flux.safetensors"
    model.write_bytes(b"x" * 10)
    (tmp_path / "link.safetensors").symlink_to(model)
    compute, cache = Counting(), tmp_path / file_hash.CACHE_FILE
    sha = file_hash.cached(compute, cache)
    assert sha(str(model)) == sha(str(tmp_path / "link.safetensors"))
    assert len(compute.read) == 1


def test_answers_that_are_not_digests_are_passed_on_and_not_kept(tmp_path):
    model = tmp_path / "flux.safetensors"
    model.write_bytes(b"x")
    cache = tmp_path / file_hash.CACHE_FILE
    odd = Counting(answer="IsADirectory")
    assert file_hash.cached(odd, cache)(str(model)) == "IsADirectory"
    assert file_hash.cached(odd, cache)(str(model)) == "IsADirectory"
    assert len(odd.read) == 2 and not cache.exists()
    missing, folder = Counting(answer="NOFILE"), Counting(answer="IsADirectory")
    assert file_hash.cached(missing, cache)(str(tmp_path / "gone")) == "NOFILE"
    assert file_hash.cached(folder, cache)(str(tmp_path)) == "IsADirectory"
    assert missing.read == [str(tmp_path / "gone")] and folder.read == [str(tmp_path)]


def test_a_damaged_or_foreign_cache_is_ignored_and_replaced(tmp_path):
    model = tmp_path / "flux.safetensors"
    model.write_bytes(b"y" * 5)
    cache = tmp_path / file_hash.CACHE_FILE
    want = hashlib.sha256(b"y" * 5).hexdigest()
    for junk in ("{not json", "[1, 2]", json.dumps({file_hash.file_key(os.stat(model), str(model)): "0" * 63})):
        cache.write_text(junk)
        compute = Counting()
        assert file_hash.cached(compute, cache)(str(model)) == want
        assert len(compute.read) == 1
    assert json.loads(cache.read_text()) == {file_hash.file_key(os.stat(model), str(model)): want}


def test_an_unwritable_cache_costs_a_warning_not_the_run(tmp_path, caplog):
    model = tmp_path / "flux.safetensors"
    model.write_bytes(b"z")
    blocker = tmp_path / "file"
    blocker.write_text("")
    compute = Counting()
    assert file_hash.cached(compute, blocker / file_hash.CACHE_FILE)(str(model)) == hashlib.sha256(b"z").hexdigest()
    assert "could not keep the model hash" in caplog.text


def test_the_cache_keeps_the_newest_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(file_hash, "KEEP", 3)
    cache = tmp_path / file_hash.CACHE_FILE
    sha = file_hash.cached(Counting(), cache)
    files = []
    for i in range(5):
        files.append(tmp_path / f"m{i}")
        files[-1].write_bytes(bytes([i]))
        sha(str(files[-1]))
    kept = json.loads(cache.read_text())
    assert [k.split("|")[0] for k in kept] == [os.path.realpath(f) for f in files[2:]]


class Slow(Counting):
    """Counting, held until `go` is set: a digest still being read when the run asks for it."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.go = threading.Event()
        self.thread: str | None = None

    def __call__(self, filename: str) -> str:
        import threading

        self.thread = threading.current_thread().name
        assert self.go.wait(10)
        return super().__call__(filename)


def test_a_file_read_ahead_is_read_once_on_its_own_thread_and_the_call_waits_for_it(tmp_path):
    model = tmp_path / "flux.safetensors"
    model.write_bytes(os.urandom(5000))
    compute, cache = Slow(), tmp_path / file_hash.CACHE_FILE
    sha256 = file_hash.cached(compute, cache)
    assert sha256.ahead(str(model)) is True
    assert sha256.ahead(str(model)) is False  # being read already: not twice
    compute.go.set()
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    assert sha256(str(model)) == want  # waits for the thread's digest
    assert compute.read == [str(model)] and compute.thread == "flux-train sha256"
    assert list(json.loads(cache.read_text()).values()) == [want]
    assert file_hash.cached(compute, cache).ahead(str(model)) is False  # kept: a later run reads nothing


def test_reading_ahead_skips_what_it_cannot_read_and_a_failed_thread_leaves_the_call_to_compute(tmp_path):
    compute, cache = Counting(), tmp_path / file_hash.CACHE_FILE
    sha256 = file_hash.cached(compute, cache)
    assert sha256.ahead(str(tmp_path / "missing.safetensors")) is False
    assert sha256.ahead(str(tmp_path)) is False  # a folder
    model = tmp_path / "flux.safetensors"
    model.write_bytes(b"x" * 64)
    calls = []

    def failing(filename):
        calls.append(filename)
        if len(calls) == 1:
            raise OSError("disk went away")
        return hashlib.sha256(open(filename, "rb").read()).hexdigest()

    sha256 = file_hash.cached(failing, cache)
    assert sha256.ahead(str(model)) is True
    assert sha256(str(model)) == hashlib.sha256(b"x" * 64).hexdigest()  # the thread failed: computed here
    assert len(calls) == 2
