"""kvsplice.utils.machine: the CPU's flags read from /proc/cpuinfo."""

from kvsplice.utils.machine import read_cpu_flags


def test_cpu_flags_come_from_the_first_cpu_in_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu avx512f amx_bf16\n\nprocessor : 1\nflags : fpu\n")
    assert read_cpu_flags(str(cpuinfo)) == {"fpu", "avx512f", "amx_bf16"}
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()
