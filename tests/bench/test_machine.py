"""The machine line: model name and the kernel-relevant flags from a cpuinfo file."""

from kvsplice.bench.machine import cpu_line


def test_cpu_line_names_the_model_and_the_kernel_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 amx_bf16\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 amx_bf16\n")
    line = cpu_line(str(info))
    assert line.startswith("Test CPU 9000, ") and line.endswith("flags: avx2 amx_bf16")
    assert cpu_line(str(tmp_path / "absent")).endswith("flags: unknown")
