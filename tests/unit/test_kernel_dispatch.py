"""loom.kernels.dispatch: the kernels chosen for a CPU's features, overrides, failed builds."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import loom.kernels as kernels
from loom.kernels import build, dispatch
from loom.kernels import cpu_kernels
from loom.kernels.dispatch import KernelChoiceError, Variant, choose
from loom.loader.model_loader import default_quantization

V3 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe".split()  # a Zen 3 (x86-64-v3)
V4 = [*V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]  # Skylake-X
CPUS = {
    "zen3": (V3, "avx2", "int16", "vnni"),
    "skylake-x": (V4, "avx512", "int16", "fp32"),
    "ice lake": ([*V4, "avx512_vnni"], "vnni", "int16", "vnni"),
    "zen4": ([*V4, "avx512_vnni", "avx512_bf16"], "bf16", "bf16", "vnni"),
    "sapphire rapids": ([*V4, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"], "amx",
                        "amx", "vnni"),
    "old x86": (["fpu", "sse2"], "generic", "fp32", "fp32"),
}


@pytest.fixture
def cpu(monkeypatch):
    """cpu(flags, arch="x86_64"): pretend to run on a CPU with these features."""
    def pretend(flags: list[str], arch: str = "x86_64") -> None:
        monkeypatch.setattr(dispatch, "cpu_features", lambda: frozenset(flags))
        monkeypatch.setattr(dispatch, "machine", lambda: arch)
    return pretend


@pytest.mark.parametrize("name", list(CPUS))
def test_each_cpu_gets_its_best_build(cpu, name) -> None:
    flags, variant, batch, decode = CPUS[name]
    cpu(flags)
    got = choose()
    assert (got.variant, got.batch, got.decode, got.kv_cache_dtype) == (variant, batch, decode,
                                                                          "int8")
    assert choose(batch_invariant=True).batch == choose(batch_invariant=True).decode == "fp32"
    line = got.describe()
    assert "\n" not in line and f"{variant} build" in line and "--cpu-kernels" in line
    # Q5_0 / Q5_1 keep 5 bits a weight where decode runs the AVX-512 VNNI kernel
    assert got.five_bit == (decode == "vnni" and "avx512bw" in flags)
    assert not choose(batch_invariant=True).five_bit


def test_aarch64_gets_neon_where_it_has_dot_products(cpu) -> None:
    cpu(["fp", "asimd", "asimddp"], "aarch64")
    assert (choose().variant, choose().batch, choose().decode) == ("neon", "vnni", "vnni")
    assert not choose().five_bit  # (its sdot kernel reads Q5 rows a byte a weight)
    assert choose().same_bits_past_8  # one sdot kernel at every size, K-quants' too
    assert (choose(batch_invariant=True).batch, choose(batch_invariant=True).decode) == (
        "vnni", "vnni")  # so --batch-invariant keeps it
    assert (choose().kquant, choose().kquant_batch) == ("neon", "int")
    cpu(["fp", "asimd"], "aarch64")  # no dot products: the same kernels in widening multiplies
    assert (choose().variant, choose().batch, choose().decode, choose().kquant) == (
        "generic", "vnni", "vnni", "neon")
    cpu(CPUS["zen3"][0])  # (x86's generic build: portable C)
    assert (choose("generic").decode, choose("generic").kquant) == ("fp32", "generic")
    cpu(["fp", "asimd"], "aarch64")
    with pytest.raises(KernelChoiceError, match="unknown CPU kernels 'avx2' for aarch64"):
        choose("avx2")


def test_aarch64_linux_reads_the_kernels_hwcaps(monkeypatch) -> None:
    """AArch64 Linux asks the kernel (getauxval) what the CPU runs, not /proc/cpuinfo, which
    under qemu-user (an arm64 container on an x86 host) is the host's: the generic build came
    of its x86 flags. Words as the kernel gives them (asm/hwcap.h's bits)."""
    graviton3 = {dispatch.AT_HWCAP: 1 << 0 | 1 << 1 | 1 << 9 | 1 << 10 | 1 << 20 | 1 << 22,
                 dispatch.AT_HWCAP2: 1 << 1 | 1 << 13 | 1 << 14}
    assert dispatch.auxv_features(lambda k: graviton3.get(k, 0)) == {
        "fp", "asimd", "fphp", "asimdhp", "asimddp", "sve", "sve2", "i8mm", "bf16"}
    pi4 = {dispatch.AT_HWCAP: 1 << 0 | 1 << 1}  # Cortex-A72: no dot products
    assert dispatch.auxv_features(lambda k: pi4.get(k, 0)) == {"fp", "asimd"}
    monkeypatch.setattr(dispatch, "machine", lambda: "aarch64")
    monkeypatch.setattr(dispatch.sys, "platform", "linux")
    for words, best in ((graviton3, "neon"), (pi4, "generic")):
        monkeypatch.setattr(dispatch, "auxv_features",
                            lambda w=words: dispatch.hwcap_features(w[dispatch.AT_HWCAP],
                                                                    w.get(dispatch.AT_HWCAP2, 0)))
        dispatch.cpu_features.cache_clear()
        try:
            assert choose().variant == best
        finally:
            dispatch.cpu_features.cache_clear()


def test_a_named_build_runs_or_says_why(cpu) -> None:
    cpu(CPUS["zen3"][0])
    assert choose("generic").variant == "generic"
    with pytest.raises(KernelChoiceError, match="'avx512' need avx512bw, avx512cd, avx512dq"):
        choose("avx512")
    with pytest.raises(KernelChoiceError, match="'avx2' failed to build"):
        choose("avx2", failed=frozenset({"avx2"}))
    assert choose(failed=frozenset({"avx2"})).variant == "generic"  # the next one down


def test_amx_tiles_withheld_by_linux_run_the_builds_bf16_kernel(cpu) -> None:
    cpu(CPUS["sapphire rapids"][0])
    amx = choose()
    assert dispatch.granted(amx, amx_tiles=True) == amx
    assert dispatch.granted(amx, amx_tiles=False) == dataclasses.replace(amx, batch="bf16")
    cpu(CPUS["zen4"][0])
    assert dispatch.granted(choose(), amx_tiles=False) == choose()  # no tiles asked for


def test_every_name_is_a_variant_and_the_best_come_first() -> None:
    for arch in ("x86_64", "aarch64"):
        names = [v.name for v in dispatch.variants(arch)]
        assert names[-1] == "generic" and len(set(names)) == len(names)
        needs = [v.needs for v in dispatch.variants(arch)]
        assert all(later <= earlier or not later for earlier, later in zip(needs, needs[1:]))
    assert set(dispatch.NAMES) == {"auto", *(v.name for v in dispatch.VARIANTS)}
    assert not any("native" in " ".join(v.cflags) for v in dispatch.VARIANTS)


@pytest.mark.slow
def test_a_variant_that_fails_to_build_is_disabled_alone_and_loudly(
        monkeypatch, tmp_path, caplog, capsys) -> None:
    """A build whose compiler fails: BuildError with the compiler's first error lines, kept as
    a .failed marker (a later start does not compile again), and "auto" falls to the next
    variant, saying so in the log."""
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    broken = Variant("broken", dispatch.machine(), ("-mno-such-option-anywhere",), frozenset())
    with pytest.raises(build.BuildError) as e:
        build.build(broken, cc, tmp_path)
    assert "could not build the broken kernels" in str(e.value)
    assert "no-such-option-anywhere" in str(e.value)
    marker = build.failed_marker(build.target(broken, cc, tmp_path))
    assert marker.read_text() == str(e.value)
    with pytest.raises(build.BuildError, match="broken kernels"):  # from the marker, at once
        build.build(broken, cc, tmp_path)
    # "auto" on a CPU whose best variant cannot build: the next one (generic, in the kernels'
    # own folder: built by the suite's kernel tests on it, else here), said in the log
    monkeypatch.setattr(dispatch, "VARIANTS", (broken, dispatch.variants()[-1]))
    kernels._selection.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="loom.kernels"):
            lib, choice = kernels._selection("auto", False)
        assert choice.variant == "generic" and lib.loom_bf16_available() == 0
        assert "CPU kernels 'broken' DISABLED" in caplog.text
        with pytest.raises(KernelChoiceError, match="'broken' failed to build"):
            kernels._selection("broken", False)
        # the install's build (`python -m loom.kernels.build`): the best variant that builds,
        # none past it (a "later" one, which would compile, is not)
        later = Variant("later", dispatch.machine(), (), frozenset())
        monkeypatch.setattr(dispatch, "VARIANTS", (broken, dispatch.VARIANTS[1], later))
        capsys.readouterr()
        assert build.main([]) == 0
        out = capsys.readouterr()
        assert "broken DISABLED" in out.err and "generic built" in out.out
        assert "later" not in out.out + out.err
    finally:
        kernels._selection.cache_clear()
        so = build.target(broken, cc)
        build.failed_marker(so).unlink(missing_ok=True)
        so.with_suffix(".lock").unlink(missing_ok=True)


# gcc whose compiles are logged and held until a file exists, then compile an empty file (the
# library links, holding nothing): a slow build whose timing the test decides
HELD_CC = """#!/bin/sh
out= prev= compiling=
for a in "$@"; do [ "$prev" = -o ] && out=$a; [ "$a" = -c ] && compiling=1; prev=$a; done
if [ -n "$compiling" ]; then
  echo "$out" >> @LOG@
  while [ ! -e @RELEASE@ ]; do sleep 0.01; done
  exec @CC@ -fPIC -x c -c /dev/null -o "$out"
fi
exec @CC@ "$@"
"""


def _until(cond, timeout: float = 60) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_two_builders_of_a_variant_compile_it_once(tmp_path) -> None:
    """Two builds of one variant at once (data-parallel replicas starting on a fresh cache, a
    first use during `make install`): the second waits on the first's lock, then takes its
    library; no source compiled twice."""
    cc = build.compiler()
    if cc is None or not os.path.exists("/proc/locks"):
        pytest.skip("needs a C compiler and Linux's /proc/locks")
    log, release = tmp_path / "compiled", tmp_path / "release"
    held = tmp_path / "held-cc"
    held.write_text(HELD_CC.replace("@CC@", cc).replace("@LOG@", str(log))
                    .replace("@RELEASE@", str(release)))
    held.chmod(0o755)
    v = Variant("held", dispatch.machine(), (), frozenset())
    out, got = tmp_path / "kernels", {}
    builders = [threading.Thread(target=lambda i=i: got.__setitem__(i, build.build(
        v, str(held), out))) for i in range(2)]
    builders[0].start()
    _until(log.exists)  # the first holds the lock, compiling
    builders[1].start()
    lock = build.target(v, str(held), out).with_suffix(".lock")
    inode = f":{lock.stat().st_ino} "
    _until(lambda: any("->" in line and inode in line  # the second waits on it
                       for line in open("/proc/locks")))
    release.touch()
    for b in builders:
        b.join(120)
    assert got[0] == got[1] and got[0].exists()
    compiled = log.read_text().split()
    assert len(compiled) == len(set(compiled)) == len(build.SOURCES)


def _gguf(*types: str, cols: int = 64) -> SimpleNamespace:
    """A GGUF reader's tensor list (and architecture): a Q8_0 embedding, F32 norms, linears of
    `types`."""
    t = [SimpleNamespace(name="token_embd.weight", tensor_type=Q.Q8_0, shape=(256, 64)),
         SimpleNamespace(name="blk.0.attn_norm.weight", tensor_type=Q.F32, shape=(64,))]
    t += [SimpleNamespace(name=f"blk.0.w{i}.weight", tensor_type=Q[q], shape=(64, cols))
          for i, q in enumerate(types)]
    return SimpleNamespace(tensors=t, get={"general.architecture": "llama"}.get)


def test_default_quantization_keeps_native_blocks_and_says_what_it_does_not(caplog) -> None:
    """quantization=None: a GGUF file's 32-wide blocks and Q2_K / Q4_K / Q5_K / Q6_K stay as they
    are (on the CPU in fp32); other types without a native kernel yet (IQ3_S) keep the reference
    path, said in one warning; float files and Hugging Face folders run in their dtype."""
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels")
    cpu, f32 = torch.device("cpu"), torch.float32
    assert default_quantization(_gguf("Q4_1", "Q4_1", "Q8_0"), cpu, f32) == "int8"
    assert default_quantization(_gguf("Q4_0", "Q5_0", "Q5_1"), cpu, f32) == "int8"
    assert default_quantization(_gguf("Q4_K", "Q6_K", "Q5_K", "Q8_0", cols=256), cpu, f32) == "int8"
    assert default_quantization(_gguf("IQ4_NL", "Q4_K", cols=256), cpu, f32) == "int8"
    assert default_quantization(_gguf("IQ4_XS", "Q5_K", "Q6_K", cols=256), cpu, f32) == "int8"
    assert default_quantization(_gguf("Q3_K", "Q5_K", "Q6_K", cols=256), cpu, f32) == "int8"
    assert default_quantization(_gguf("Q2_K", "Q3_K", "Q4_K", cols=256), cpu, f32) == "int8"
    assert default_quantization(_gguf("F16", "F32"), cpu, f32) is None
    assert default_quantization(None, cpu, f32) is None
    experts = SimpleNamespace(name="blk.0.ffn_gate_exps.weight", tensor_type=Q.Q4_K,
                              shape=(4, 64, 256))  # [experts, rows, cols]
    moe = _gguf("F16", "F32")
    moe.tensors.append(experts)  # F16 dense layers, K-quant experts: the experts stay blocks
    assert default_quantization(moe, cpu, f32) == "int8"
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="loom.loader.model_loader"):
        assert default_quantization(_gguf("IQ3_S", "Q4_K", "Q8_0", cols=256), cpu, f32) is None
        assert default_quantization(_gguf("Q4_0"), cpu, torch.bfloat16) is None
        experts.tensor_type = Q.IQ3_S
        assert default_quantization(moe, cpu, f32) is None
    first, second, third = (r.getMessage() for r in caplog.records)
    assert "IQ3_S have no native kernel yet" in first and "--quantization int8" in first
    assert "float32 activations only" in second
    assert "IQ3_S have no native kernel yet" in third


def test_the_flag_offers_every_build() -> None:
    """--cpu-kernels lists its choices without importing the kernels (torch): the same names."""
    from dataclasses import fields

    from loom.engine.args import EngineArgs

    field = next(f for f in fields(EngineArgs) if f.name == "cpu_kernels")
    assert field.default == "auto" and set(field.metadata["choices"]) == set(dispatch.NAMES)
