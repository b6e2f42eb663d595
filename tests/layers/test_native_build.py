"""kvsplice.layers.native_build: a C source built once per key into the given directory, loaded,
and every way it cannot be had raised as NativeUnavailable with the reason."""

import pytest

from kvsplice.layers.native_build import NativeUnavailable, find_c_compiler, load_native

needs_cc = pytest.mark.skipif(find_c_compiler() is None, reason="no C compiler to build with")


@needs_cc
def test_a_library_is_built_once_per_key_and_reused(tmp_path):
    library = load_native("int8_tiles", tmp_path)
    built = sorted(tmp_path.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so" and library.int8_tiles_max_rows() == 8
    stamp = built[0].stat().st_mtime_ns
    load_native("int8_tiles", tmp_path)
    assert sorted(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp   # not rebuilt
    load_native("int8_tiles", tmp_path, extra_flags=("-DKVSPLICE_TEST_KEY",))   # other flags: another key
    assert len(list(tmp_path.iterdir())) == 2


@needs_cc
def test_a_failed_build_says_what_the_compiler_said_and_leaves_nothing(tmp_path):
    with pytest.raises(NativeUnavailable, match="exited"):
        load_native("int8_tiles", tmp_path, extra_flags=("-fno-such-flag-anywhere",))
    assert not any(tmp_path.iterdir())


def test_without_a_compiler_it_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(NativeUnavailable, match=r"no C compiler \(\$CC"):
        load_native("int8_tiles", tmp_path)
