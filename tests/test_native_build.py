"""How the CPU kernels are built: the build is cached by source and flags, and a machine without a
compiler, a source that does not compile or a cache folder it may not write falls back (to the torch
path, or the temp folder) instead of failing the worker."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from worker.model import native
from worker.model.native import COMPILERS, load_native_kernels

if not any(shutil.which(c) for c in COMPILERS):
    pytest.skip("no C compiler on this machine: the model uses its torch path", allow_module_level=True)


def test_the_build_is_cached_and_a_missing_compiler_falls_back(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A one-function source with the kernels' flags: what is tested is the cache, not the
    # kernels' compile (~60 s on 2 cores; the builds in test_native and test_native_layers do that).
    source = tmp_path / "src" / "one.c"
    source.parent.mkdir()
    source.write_text("int tokenrelay_one(void) { return 1; }\n")
    cache = tmp_path / "cache"
    built = native._build((source,), cache)
    mtime = built.stat().st_mtime_ns
    assert native._build((source,), cache) == built  # the second call reuses it,
    assert built.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in cache.iterdir()] == [built.name]  # no temporary files left behind
    source.write_text("int tokenrelay_one(void) { return 2; }\n")
    assert native._build((source,), cache) != built  # another source, another build
    monkeypatch.setattr(native, "COMPILERS", ("no-such-compiler-here",))
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(tmp_path / "other") is None
    finally:
        load_native_kernels.cache_clear()


def test_a_compile_error_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCES", (bad,))
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(tmp_path / "cache") is None
    finally:
        load_native_kernels.cache_clear()


# as os.mkdir fails there: a folder of another user's, or a read-only root file system (a locked-down pod)
@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "Permission denied"),
                                   OSError(errno.EROFS, "Read-only file system")])
def test_an_unwritable_cache_folder_falls_back_to_the_temp_folder(tmp_path: Path, error: OSError,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "read-only-home"
    fallback = tmp_path / "tmp" / f"tokenrelay-kernels-{os.getuid()}"
    real_build = native._build
    # The fallback folder already holds this build, copied from where the session built it: what
    # is tested is where the loader looks, not the compiler (~45 s a compile here;
    # test_the_build_is_cached_and_a_missing_compiler_falls_back compiles into a fresh folder).
    try:
        built = real_build(native.SOURCES, native._default_cache_dir())
    except OSError:  # a home this test cannot write either: seed from a compile of its own
        built = real_build(native.SOURCES, tmp_path / "seed")
    fallback.mkdir(parents=True)
    shutil.copy2(built, fallback / built.name)
    asked: list[Path] = []

    def build(sources: tuple[Path, ...], cache_dir: Path) -> Path:
        asked.append(cache_dir)
        if cache_dir.is_relative_to(locked):
            raise error
        return real_build(sources, cache_dir)

    monkeypatch.setattr(native, "_build", build)
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(locked / "kernels") is not None
        assert asked == [locked / "kernels", fallback]
    finally:
        load_native_kernels.cache_clear()
