"""Weights as a node keeps them: GGUF 4-bit blocks repacked for torch's int4 kernel, int8 rows,
bfloat16, and the float32 exact mode (swarm's own kernels on the file's blocks: test_kernels.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from swarm.model.blocks import KVCache, Span
from swarm.model.linear import BLOCKS, Blocks, Dense, Int4, Int8
from swarm.model.quant import gguf_int4, quantize_int4
from swarm.model.source import default_model_path, open_model
from swarm.model.weights import RawTensor, make_linear
from tests.helpers.kernels import TORCH_KERNELS, as_float32

BF16_STEP = 2.0**-8  # bfloat16 keeps 8 significant bits: rounding moves a value by <= 2^-8 of it


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid GGUF blocks of type `kind`: random code bytes, sane float16 headers."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    halves = 1 if kind == "Q4_0" else 2  # Q4_1 and Q4_K lead with two float16s
    header = rng.uniform(0.001, 0.05, size=(rows, cols // block, halves)).astype(np.float16)
    raw[..., : 2 * halves] = header.view(np.uint8).reshape(rows, cols // block, 2 * halves)
    return raw.reshape(rows, -1)


def gguf_dequantized(raw: np.ndarray, kind: str) -> np.ndarray:
    return gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_blocks_read_as_codes_give_ggufs_own_dequantization(kind):
    raw = random_blocks(kind, 64, 512)
    groups = gguf_int4(raw, kind)
    assert groups.codes.max() <= 15
    np.testing.assert_allclose(groups.dequantize(), gguf_dequantized(raw, kind), rtol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_packing_keeps_every_code_of_the_file(kind):
    raw = random_blocks(kind, 96, 256, seed=1)
    groups = gguf_int4(raw, kind)
    assert torch.equal(Int4(groups).codes(), torch.from_numpy(groups.codes))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_packed_int4_dequantizes_to_gguf_within_bfloat16_rounding_of_its_scales(kind):
    """The codes are the file's; only scale and zero are rounded, to the kernel's bfloat16."""
    raw = random_blocks(kind, 64, 512, seed=2)
    groups = gguf_int4(raw, kind)
    packed = Int4(groups).dequantized().numpy()
    exact = gguf_dequantized(raw, kind)
    rows, cols = exact.shape
    scale = np.repeat(np.abs(groups.scale), 32, axis=1)
    zero = np.repeat(np.abs(groups.offset + 8 * groups.scale), 32, axis=1)
    bound = (8 * scale + zero) * BF16_STEP + 1e-7
    assert (np.abs(packed - exact) <= bound).all()
    assert np.abs(packed - exact).max() < np.abs(exact).max() * BF16_STEP


def test_the_default_models_q4_1_projection_repacks_into_its_float32_rows():
    """Un-permuting llama.cpp's q rows on the file's bytes gives the rows float32 loading gives."""
    source = open_model(default_model_path())
    raw = source.raw("blk.3.attn_q.weight")
    assert raw.kind == "Q4_1"
    int4 = make_linear(raw, "int4", usable=TORCH_KERNELS)
    assert isinstance(int4, Int4)
    exact = raw.float32()
    assert (int4.dequantized() - exact).abs().max() < exact.abs().max() * BF16_STEP


def test_the_default_models_q4_1_projection_keeps_its_blocks_under_swarms_kernels():
    source = open_model(default_model_path())
    raw = source.raw("blk.3.attn_q.weight")
    linear = make_linear(raw, "int4", usable=(*TORCH_KERNELS, BLOCKS))
    if not isinstance(linear, Blocks):
        pytest.skip("swarm's kernels do not load here")
    assert torch.equal(linear.dequantized(), raw.float32())


def test_quantizing_float_weights_to_int4_errs_by_at_most_half_a_step():
    w = torch.randn(64, 256) * 0.05
    groups = quantize_int4(w.numpy())
    step = np.repeat(groups.scale, 32, axis=1)
    err = np.abs(Int4(groups).dequantized().numpy() - w.numpy())
    assert (err <= step * (0.5 + BF16_STEP * 16) + 1e-7).all()


def test_int8_rows_err_by_at_most_half_a_step_of_their_row():
    w = torch.randn(48, 200) * 0.05
    int8 = Int8.quantize(w)
    step = int8.scales.float()[:, None]
    assert ((int8.dequantized() - w).abs() <= step * 0.5001).all()


@pytest.mark.parametrize("make", [Int8.quantize, lambda w: Int4(quantize_int4(w.numpy()))])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_quantized_kernels_multiply_by_the_weights_they_hold(make, rows):
    w = torch.randn(128, 256) * 0.05
    linear = make(w)
    x = torch.randn(rows, 256)
    want = x @ linear.dequantized().T
    got = linear(x).float()
    # decode rows go through the kernels in bfloat16 activations; int8 prompt rows in float32
    assert (got - want).abs().max() < want.abs().max() * 0.02


def test_float32_weights_stay_the_exact_path():
    w = torch.randn(64, 32)
    linear = make_linear(RawTensor("w", "torch", w), "float32")
    assert isinstance(linear, Dense) and linear.weight.dtype == torch.float32
    x = torch.randn(2, 32)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize(
    "kind, fmt",
    [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q8_0", "int8"), ("Q6_K", "int8")],
)
def test_auto_keeps_each_gguf_type_in_its_own_kind_of_format(kind, fmt):
    qtype = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((32, 256 // block * nbytes), dtype=np.uint8)
    assert make_linear(RawTensor("w", kind, raw), "auto").format == fmt


def test_float_tensors_load_as_bfloat16_under_auto():
    linear = make_linear(RawTensor("w", "torch", torch.randn(32, 64)), "auto")
    assert linear.format == "bfloat16"


def test_a_shape_the_int4_kernel_cannot_pack_steps_down_to_int8():
    linear = make_linear(RawTensor("w", "torch", torch.randn(24, 64)), "int4")
    assert linear.format == "int8"


def test_a_format_this_cpu_cannot_run_steps_down():
    raw = RawTensor("w", "torch", torch.randn(32, 64))
    assert make_linear(raw, "int4", usable=("float32", "bfloat16", "int8")).format == "int8"
    assert make_linear(raw, "int4", usable=("float32", "bfloat16")).format == "bfloat16"


def test_an_unknown_weight_format_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="weights 'int3'"):
        Span.load(open_model(str(tiny_model_dir)), 0, 2, weights="int3")


def test_the_kv_cache_holds_half_the_bytes_per_token_outside_the_exact_mode(tiny_model_dir):
    source = open_model(str(tiny_model_dir))
    exact = Span.load(source, 0, 2, weights="float32")
    packed = Span.load(source, 0, 2, weights="int4")

    def bytes_per_token(span: Span) -> int:
        return KVCache.bytes_per_token(source.config, 2, span.cache_dtype)

    assert bytes_per_token(packed) * 2 == bytes_per_token(exact)
    assert packed.allocate_cache(0, 2, 8).keys[0].dtype == torch.bfloat16
    assert KVCache.bytes_per_token(source.config, 2) == bytes_per_token(exact)


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4"])
def test_a_quantized_span_computes_what_its_weights_give_in_float32(tiny_model_dir, weights):
    """Prompt pass and decode steps in bfloat16 activations and cache stay with the float32
    math over the very weights the format holds (the format's own error is measured apart)."""
    span = Span.load(open_model(str(tiny_model_dir)), 0, 6, weights=weights)
    prompt = torch.randn(1, 40, span.config.hidden)
    outs = []
    for s in (as_float32(span), span):
        cache = s.allocate_cache(0, 6, 48)
        hidden = s.forward(prompt, cache, 0, 0, 6)
        steps = [s.forward(hidden[:, -1:], cache, 40 + i, 0, 6) for i in range(3)]
        outs.append(torch.cat([hidden, *steps], dim=1))
    cos = torch.nn.functional.cosine_similarity(*outs, dim=-1)
    assert cos.min() > 0.99, f"{weights}: cosine to float32 as low as {cos.min():.4f}"


def test_a_span_counts_its_bytes_and_formats(tiny_model_dir):
    source = open_model(str(tiny_model_dir))
    exact = Span.load(source, 0, 3, weights="float32")
    packed = Span.load(source, 0, 3, weights="int4")
    assert exact.formats == {"float32": 21} and packed.format == "int4"
    assert packed.nbytes < exact.nbytes / 5
