"""What the bench records of the machine: the CPU's name, from /proc/cpuinfo where there is one."""

from __future__ import annotations

import platform

from duo.bench import machine


def test_the_cpu_is_named_as_proc_cpuinfo_names_it(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654\nflags\t\t: avx2\n")
    monkeypatch.setattr(machine, "Path", lambda path: cpuinfo)
    assert machine.cpu_model() == "AMD EPYC 9654"


def test_without_proc_cpuinfo_the_platform_names_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "Path", lambda path: tmp_path / "none")  # macOS has no /proc
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert machine.cpu_model() == "arm"
