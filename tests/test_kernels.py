"""swarm's own quantized matmuls (swarm/model/kernels) on GGUF's blocks, for every instruction set
this CPU runs: what they compute against the dequantized weights, and what they keep."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from swarm.model import kernels
from swarm.model.blocks import Span
from swarm.model.linear import BLOCKS, Blocks, Dense, Int4, Int8
from swarm.model.source import open_model
from swarm.model.usable import usable_formats
from swarm.model.weights import Fused, RawTensor, make_linear
from tests.helpers.kernels import ISAS, TORCH_KERNELS, as_float32, lib_for, needs_kernels
from tests.helpers.scripts import synthetic_gguf

KINDS = list(kernels.FORMATS)
# where each block's float16 scales sit: (offset, count)
_HALVES = {
    "Q4_0": (0, 1),
    "Q4_1": (0, 2),
    "Q8_0": (0, 1),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, 1),
}  # MXFP4's scale is an exponent byte: see random_blocks


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Any bytes for codes, scales and mins (every bit pattern the format allows), with sane
    float16 scales (MXFP4: exponent bytes 2^-10 .. 2^2)."""
    rng = np.random.default_rng(seed)
    block, nbytes = kernels.BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    if kind == "MXFP4":
        raw[..., 0] = rng.integers(117, 130, size=(rows, cols // block))
        return raw.reshape(rows, -1)
    at, count = _HALVES[kind]
    halves = rng.uniform(0.001, 0.05, size=(rows, cols // block, count)).astype(np.float16)
    raw[..., at : at + 2 * count] = halves.view(np.uint8).reshape(rows, cols // block, 2 * count)
    return raw.reshape(rows, -1)


def dequantized(blocks: np.ndarray, kind: str) -> np.ndarray:
    return gguf.dequantize(blocks, gguf.GGMLQuantizationType[kind]).astype(np.float64)


def rounding_bound(x: np.ndarray, w: np.ndarray, kind: str, terms: int) -> np.ndarray:
    """How far x W^T may be from the kernels' result [rows, n]: they round x to int8 with one
    scale per group of inputs (32, or 256 for the K formats), each input by at most half a step
    (amax / 254), or with a second int8 term for that error, half of its step (a 254th of the
    first's), and add in float32 (a relative 1e-5 is ample for these widths)."""
    group = 256 if kind.endswith("_K") else 32
    rows, cols = x.shape
    amax = np.abs(x).reshape(rows, cols // group, group).max(-1)
    half_step = amax / 254.0 if terms == 1 else amax / 127.0 / 254.0 / 2.0
    step = np.repeat(half_step, group, axis=1)  # [rows, cols]
    return step @ np.abs(w).T * (1 + 1e-5) + np.abs(x) @ np.abs(w).T * 1e-5 + 1e-6


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_packing_keeps_the_files_bytes(isa, kind):
    lib = lib_for(isa)
    blocks = random_blocks(kind, 40, 512, seed=1)  # 40 rows: a partial last group of rows
    packed = lib.pack(kind, blocks, 512)
    assert packed.numel() >= blocks.nbytes
    assert np.array_equal(lib.unpack(kind, packed, 40, 512), blocks)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 64])
@pytest.mark.parametrize("terms", [1, 2])
def test_kernels_multiply_by_the_dequantized_weights_within_the_inputs_int8_rounding(
    isa, kind, rows, terms
):
    lib = lib_for(isa)
    n, k = 56, 768  # 56 rows: no multiple of 16
    blocks = random_blocks(kind, n, k, seed=rows)
    w = dequantized(blocks, kind)
    x = np.random.default_rng(rows).standard_normal((rows, k))
    x[:, :32] *= 40.0  # one loud group: each group must keep its own scale
    packed = lib.pack(kind, blocks, k)
    got = lib.matmul(kind, packed, n, k, torch.from_numpy(x).float(), 1, terms)
    want = x.astype(np.float32).astype(np.float64) @ w.T
    err = np.abs(got.double().numpy() - want)
    bound = rounding_bound(x.astype(np.float32), w, kind, terms)
    assert (err <= bound).all(), f"worst: {(err / bound).max():.3f} of the bound"


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_real_weights_give_float_results_within_a_percent_or_1e_4(isa, kind):
    """Trained-like weights (quantized from N(0, 0.02)) and inputs: the result's error is small
    beside the output itself, not only within the worst-case bound: a percent with one int8
    term, 1e-4 with two."""
    lib = lib_for(isa)
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32)
    blocks = synthetic_gguf.quantize(w, kind)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    packed = lib.pack(kind, blocks, 1024)
    want = x @ dequantized(blocks, kind).T
    for terms, within in ((1, 0.01), (2, 1e-4)):
        got = lib.matmul(kind, packed, 64, 1024, torch.from_numpy(x), 1, terms)
        assert np.abs(got.numpy() - want).max() < within * np.abs(want).max()


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_threads_split_the_rows_without_changing_a_bit(isa):
    lib = lib_for(isa)
    # 11 x 2000 x 512 multiply-adds: above MIN_SPLIT_MACS, under which one thread does it all
    blocks = random_blocks("Q4_K", 2000, 512, seed=4)
    packed = lib.pack("Q4_K", blocks, 512)
    x = torch.randn(11, 512)
    one = lib.matmul("Q4_K", packed, 2000, 512, x, 1)
    assert torch.equal(one, lib.matmul("Q4_K", packed, 2000, 512, x, 2))
    assert torch.equal(one, lib.matmul("Q4_K", packed, 2000, 512, x, 3))


@needs_kernels
def test_calls_in_quick_succession_on_threads_each_get_their_whole_result():
    # helpers stay awake between calls and join each as it opens: a helper still at work on
    # one call, or joining it late, must not leave the next one short of rows
    lib = kernels.load()
    # units of ~1 ms (32 weight rows of 8192 against 33 x rows): one ending late shows
    shapes = [(1000, 8192), (700, 8192)]
    packed = {s: lib.pack("Q4_K", random_blocks("Q4_K", *s, seed=s[0]), s[1]) for s in shapes}
    xs = {s: torch.randn(33, s[1]) for s in shapes}
    want = {s: lib.matmul("Q4_K", packed[s], *s, xs[s], 1) for s in shapes}
    for i in range(100):
        s = shapes[i % 2]
        assert torch.equal(lib.matmul("Q4_K", packed[s], *s, xs[s], 3), want[s]), f"call {i}"


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_a_small_matmul_does_not_wait_for_a_long_one_on_another_thread(threads):
    # a node's decode lane and prefill lane call at once: the decode step's one row must not
    # queue behind a prompt pass's many, and both must get exactly their own results
    lib = kernels.load()
    big = lib.pack("Q4_K", random_blocks("Q4_K", 4096, 4096, seed=7), 4096)
    small = lib.pack("Q4_K", random_blocks("Q4_K", 256, 4096, seed=8), 4096)
    # 1024 rows: the long call must outlast the 5 ms head start and five small calls by far
    # on the fastest kernels (128 rows took 8 ms at 2 threads with one input term)
    xb, xs = torch.randn(1024, 4096), torch.randn(1, 4096)
    want_b = lib.matmul("Q4_K", big, 4096, 4096, xb, threads)
    want_s = lib.matmul("Q4_K", small, 256, 4096, xs, 1)
    started, done = threading.Event(), {}

    def long_call():
        started.set()
        done["big"] = (lib.matmul("Q4_K", big, 4096, 4096, xb, threads), time.perf_counter())

    t = threading.Thread(target=long_call)
    t0 = time.perf_counter()
    t.start()
    started.wait()
    time.sleep(0.005)  # the long call is under way
    got = [lib.matmul("Q4_K", small, 256, 4096, xs, 1) for _ in range(5)]
    small_done = time.perf_counter()
    t.join()
    big_out, big_done = done["big"]
    assert small_done < big_done, (small_done - t0, big_done - t0)
    assert all(torch.equal(g, want_s) for g in got)
    assert torch.equal(big_out, want_b)


@needs_kernels
def test_a_forked_child_multiplies_on_threads_of_its_own():
    lib = kernels.load()
    packed = lib.pack("Q4_K", random_blocks("Q4_K", 2000, 512, seed=5), 512)
    x = torch.randn(11, 512)
    want = lib.matmul("Q4_K", packed, 2000, 512, x, 2)  # the parent's helpers are up
    child = os.fork()
    if child == 0:  # the child has none of them: it must start its own, not wait on the parent's
        os._exit(0 if torch.equal(lib.matmul("Q4_K", packed, 2000, 512, x, 2), want) else 1)
    for _ in range(300):
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.1)
    os.kill(child, 9)
    os.waitpid(child, 0)
    pytest.fail("the forked child's matmul did not return in 30 s")


@needs_kernels
def test_a_width_the_format_cannot_hold_is_refused():
    lib = lib_for(ISAS[0])
    with pytest.raises(kernels.KernelError):
        lib.pack("Q4_K", np.zeros((8, 100), dtype=np.uint8), 200)


@needs_kernels
@pytest.mark.parametrize(
    "kind, fmt",
    [
        ("Q4_0", "int4"),
        ("Q4_K", "int4"),
        ("Q8_0", "int8"),
        ("Q6_K", "int8"),
        ("Q4_1", "int4"),
        ("Q5_K", "int8"),
        ("MXFP4", "int4"),
    ],
)
def test_auto_keeps_the_files_blocks_and_names_their_kind_of_format(kind, fmt):
    raw = RawTensor("w", kind, random_blocks(kind, 48, 512))
    linear = make_linear(raw, "auto")
    assert isinstance(linear, Blocks) and linear.format == fmt
    assert torch.equal(linear.dequantized(), raw.float32())
    assert linear.nbytes <= raw.data.nbytes * 1.03  # Q4_K's scales widened: +2.8%


@needs_kernels
def test_fused_matrices_of_one_type_keep_their_blocks_stacked():
    raws = [
        RawTensor(n, "Q4_0", random_blocks("Q4_0", r, 256, seed=i))
        for i, (n, r) in enumerate([("q", 64), ("k", 32), ("v", 32)])
    ]
    fused = Fused.load(raws, "auto", [None, None, None])
    assert len(fused.linears) == 1 and isinstance(fused.linears[0], Blocks)
    x = torch.randn(3, 256)
    want = torch.cat([x @ r.float32().T for r in raws], dim=-1)
    assert (fused(x) - want).abs().max() < 0.02 * want.abs().max()


@needs_kernels
def test_fused_matrices_of_different_types_multiply_apart():
    """Q4_K_M files keep some v in Q6_K: both int8-class and int4-class blocks, each its own."""
    raws = [
        RawTensor("k", "Q4_K", random_blocks("Q4_K", 32, 256)),
        RawTensor("v", "Q6_K", random_blocks("Q6_K", 32, 256)),
    ]
    fused = Fused.load(raws, "auto", [None, None])
    assert [lin.kind for lin in fused.linears] == ["Q4_K", "Q6_K"]


def test_without_blocks_in_usable_torchs_kernels_hold_the_weights():
    raw = RawTensor("w", "Q4_0", random_blocks("Q4_0", 64, 256))
    assert isinstance(make_linear(raw, "auto", usable=TORCH_KERNELS), Int4)
    raw8 = RawTensor("w", "Q8_0", random_blocks("Q8_0", 64, 256))
    assert isinstance(make_linear(raw8, "auto", usable=TORCH_KERNELS), Int8)


def test_where_the_kernels_do_not_load_torchs_hold_the_weights(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda isa=None: None)
    raw = RawTensor("w", "Q4_K", random_blocks("Q4_K", 64, 256))
    assert isinstance(make_linear(raw, "auto", usable=(*TORCH_KERNELS, BLOCKS)), Int4)


def test_where_the_kernels_do_not_load_mxfp4_is_held_exactly_in_bfloat16(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda isa=None: None)
    raw = RawTensor("w", "MXFP4", random_blocks("MXFP4", 64, 256))
    linear = make_linear(raw, "auto", usable=(*TORCH_KERNELS, BLOCKS))
    assert isinstance(linear, Dense) and linear.format == "bfloat16"
    assert torch.equal(linear.dequantized(), raw.float32())  # E2M1 x 2^e: bfloat16 holds it


def test_where_the_kernels_do_not_load_the_node_is_told_mxfp4_steps_down(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda isa=None: None)
    said = []
    usable_formats(said.append)
    assert any("MXFP4" in line and "bfloat16" in line for line in said)


def test_asked_for_int8_mxfp4_is_requantized():
    raw = RawTensor("w", "MXFP4", random_blocks("MXFP4", 64, 256))
    assert isinstance(make_linear(raw, "int8"), Int8)


# E2M1 (OCP microscaling): sign, 2 exponent bits, 1 mantissa bit; exponent 0 is subnormal
def _e2m1(code: int) -> float:
    sign, exp, man = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def test_the_mxfp4_reference_decodes_as_the_ocp_format_says():
    """gguf-py's dequantizer, which the kernels' tests and the bfloat16 fallback trust: each
    block is an E8M0 byte e (2^(e - 127)), then 16 bytes whose low nibbles are elements 0-15
    and high nibbles 16-31."""
    blocks = random_blocks("MXFP4", 8, 256, seed=7).reshape(8, 8, 17)
    blocks[0, :, 0] = [0, 1, 2, 127, 128, 200, 251, 252]  # subnormal scales; the largest finite
    codes = np.concatenate([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], axis=-1)
    table = np.array([_e2m1(c) for c in range(16)])
    want = table[codes] * np.exp2(blocks[..., :1].astype(np.float64) - 127)
    got = dequantized(blocks.reshape(8, -1), "MXFP4").reshape(8, 8, 32)
    assert np.array_equal(got, want)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_every_mxfp4_exponent_scales_its_block_exactly(isa):
    """One block's codes under each E8M0 byte 0 .. 240 (2^-127 .. 2^113; 0 and 1 scale below
    float32's normal range): each row's result is the unscaled row's times its scale, within
    the inputs' int8 rounding."""
    lib = lib_for(isa)
    e = np.arange(241)
    blocks = np.repeat(random_blocks("MXFP4", 1, 64, seed=9).reshape(1, 2, 17), len(e), axis=0)
    blocks[..., 0] = e[:, None]
    unscaled = blocks.copy()
    unscaled[..., 0] = 127
    x = np.random.default_rng(9).standard_normal((2, 64)).astype(np.float32)
    got = (
        lib.matmul(
            "MXFP4",
            lib.pack("MXFP4", blocks.reshape(len(e), -1), 64),
            len(e),
            64,
            torch.from_numpy(x),
            1,
            1,
        )
        .double()
        .numpy()
    )
    w = dequantized(unscaled.reshape(len(e), -1), "MXFP4")
    err = np.abs(got * np.exp2(127.0 - e) - x @ w.T)
    assert (err <= rounding_bound(x, w, "MXFP4", 1)).all()


def test_a_non_native_format_is_not_kept_in_blocks():
    raw = RawTensor("w", "Q8_0", random_blocks("Q8_0", 64, 256))
    assert isinstance(make_linear(raw, "int4"), Int4)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_a_gguf_span_on_the_kernels_computes_what_its_weights_give_in_float32(tmp_path, qtype):
    """Prompt pass and decode steps of a synthetic Llama file, every matrix in the file's blocks,
    against the same span with the blocks dequantized to float32."""
    shapes = synthetic_gguf.Shapes(
        hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=512, layers=2
    )
    path = synthetic_gguf.write_synthetic_gguf(tmp_path / f"s.{qtype}.gguf", shapes, qtype)
    span = Span.load(open_model(path), 0, 2, weights="auto")
    assert all(isinstance(lin, Blocks) for b in span.blocks for lin in b.linears)
    prompt = torch.randn(1, 24, 256)
    outs = []
    for s in (as_float32(span), span):
        cache = s.allocate_cache(0, 2, 32)
        hidden = s.forward(prompt, cache, 0, 0, 2)
        steps = [s.forward(hidden[:, -1:], cache, 24 + i, 0, 2) for i in range(3)]
        outs.append(torch.cat([hidden, *steps], dim=1))
    cos = torch.nn.functional.cosine_similarity(*outs, dim=-1)
    assert cos.min() > 0.99, f"{qtype}: cosine to float32 as low as {cos.min():.4f}"


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind):
    """Batched decode gives each session what it would get alone, to the bit."""
    lib = lib_for(ISAS[0])
    blocks = random_blocks(kind, 64, 512, seed=5)
    packed = lib.pack(kind, blocks, 512)
    x = torch.randn(13, 512)
    together = lib.matmul(kind, packed, 64, 512, x, 1)
    for i in (0, 5, 12):
        assert torch.equal(lib.matmul(kind, packed, 64, 512, x[i : i + 1], 1)[0], together[i])


def load_with_isa_env(value: str) -> subprocess.CompletedProcess:
    """A fresh process loads the kernels with $SWARM_KERNELS_ISA set: it prints their isa."""
    code = "from swarm.model import kernels; lib = kernels.load(); print(lib and lib.isa)"
    env = {**os.environ, kernels.ISA_ENV: value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("isa", ISAS)
def test_the_environment_picks_an_instruction_set_this_cpu_runs(isa):
    """What an AVX2-only machine runs can be measured on an AVX-512 one."""
    out = load_with_isa_env(isa)
    assert out.stdout.strip() == isa, out.stderr


@needs_kernels
def test_an_instruction_set_this_cpu_lacks_falls_back_to_the_best():
    out = load_with_isa_env("avx9000")
    assert out.stdout.strip() == ISAS[0]
    assert "avx9000" in out.stderr


@needs_kernels
def test_the_input_terms_a_matrix_is_loaded_with_reach_every_blocks_matmul():
    """Two spans in one process may take their inputs in different terms."""
    raw = RawTensor("w", "Q4_K", random_blocks("Q4_K", 64, 512))
    usable = (*TORCH_KERNELS, BLOCKS)
    linears = {t: make_linear(raw, "auto", usable=usable, terms=t) for t in (1, 2)}
    x = torch.randn(3, 512)
    lib = kernels.load()
    want = {t: lib.matmul("Q4_K", linears[t].packed, 64, 512, x, 1, t) for t in (1, 2)}
    assert not torch.equal(want[1], want[2])
    for terms in (1, 2):
        assert torch.equal(linears[terms](x).float(), want[terms])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_unset_input_terms_follow_the_instruction_set(isa):
    """One on every instruction set: a second slows every pass where compute sets the pace."""
    lib = lib_for(isa)
    blocks = random_blocks("Q4_0", 32, 256)
    packed = lib.pack("Q4_0", blocks, 256)
    x = torch.randn(2, 256)
    own = {"avx512vnni": 1, "avx2": 1}[isa]
    assert kernels.input_terms(isa) == own
    assert torch.equal(
        lib.matmul("Q4_0", packed, 32, 256, x, 1), lib.matmul("Q4_0", packed, 32, 256, x, 1, own)
    )
    assert not torch.equal(
        lib.matmul("Q4_0", packed, 32, 256, x, 1),
        lib.matmul("Q4_0", packed, 32, 256, x, 1, 3 - own),
    )


def test_input_terms_other_than_one_or_two_are_refused():
    with pytest.raises(ValueError, match="1, 2 or auto"):
        kernels.input_terms("avx2", 3)
    assert kernels.input_terms("avx2") == 1


def smaps_entry(address: int) -> dict[str, str]:
    """The fields /proc/self/smaps gives for the mapping holding `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@needs_kernels
def test_a_matrix_of_2_mib_or_more_is_packed_on_memory_advised_for_huge_pages():
    lib = lib_for(ISAS[0])
    blocks = random_blocks("Q4_0", 4096, 1024, seed=3)  # 2.25 MiB packed
    packed = lib.pack("Q4_0", blocks, 1024)
    assert packed.data_ptr() % kernels.HUGE_PAGE == 0
    assert np.array_equal(lib.unpack("Q4_0", packed, 4096, 1024), blocks)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel has transparent huge pages off")
    assert smaps_entry(packed.data_ptr()).get("THPeligible") == "1"


@needs_kernels
def test_a_small_matrix_is_packed_on_torchs_own_memory():
    lib = lib_for(ISAS[0])
    packed = lib.pack("Q4_0", random_blocks("Q4_0", 64, 512), 512)
    assert packed.numel() < kernels.HUGE_PAGE and packed._base is None
