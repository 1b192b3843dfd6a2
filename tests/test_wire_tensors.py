"""A step's tensors on a node's event loop go through numpy, not torch (each torch call there
costs ~30-40 us with its code out of the caches): the same numbers as torch's conversions, the
same refusals, and a first hop's Q8_0 embedding rows as gguf dequantizes them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from swarm.errors import ShapeMismatch
from swarm.model.source import open_model
from swarm.model.weights import RawTensor
from swarm.wire import pack_tensor, unpack_tensor

# values where float16 rounds, overflows, goes subnormal, or keeps a sign
EDGES = [0.0, -0.0, 1.0 / 3, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-5, -2.5e-6, 1 + 2**-11]


def activations(tokens: int = 3, hidden: int = 64) -> torch.Tensor:
    x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(5)) * 40
    x[0, 0, : len(EDGES)] = torch.tensor(EDGES)
    return x


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_packed_activations_are_torchs_own_conversion(dtype):
    x = activations()
    packed = pack_tensor(x, dtype)
    expected = x.to(getattr(torch, dtype))
    raw = expected.view(torch.int16) if dtype == "bfloat16" else expected
    assert packed["shape"] == [1, 3, 64]
    assert packed["data"] == raw.numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_unpacked_activations_widen_to_torchs_float32(dtype):
    x = activations().clamp(-6e4, 6e4)
    got = unpack_tensor(pack_tensor(x, dtype), hidden=64, max_tokens=8)
    assert got.dtype == torch.float32
    assert torch.equal(got, x.to(getattr(torch, dtype)).float())


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_native_unpacking_keeps_the_wire_dtype(dtype):
    x = activations().clamp(-6e4, 6e4)
    got = unpack_tensor(pack_tensor(x, dtype), hidden=64, max_tokens=8, native=True)
    assert got.dtype == getattr(torch, dtype)
    assert torch.equal(got, x.to(getattr(torch, dtype)))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_anywhere_is_refused(dtype, bad):
    x = activations().clamp(-6e4, 6e4)
    x[0, 2, 63] = bad
    with pytest.raises(ShapeMismatch, match="NaN or Inf"):
        unpack_tensor(pack_tensor(x, dtype), hidden=64, max_tokens=8)


def test_large_finite_float32_values_are_not_mistaken_for_overflow():
    x = torch.full((1, 2, 64), 3.0e38)
    assert torch.equal(unpack_tensor(pack_tensor(x, "float32"), hidden=64, max_tokens=8), x)


def test_a_q8_0_tables_rows_are_ggufs_dequantized_rows():
    table = open_model(None).embed_raw()
    assert table.kind == "Q8_0"
    ids = [0, 5, 49151, 1234, 5]
    whole = gguf.dequantize(table.data[np.asarray(ids)], gguf.GGMLQuantizationType.Q8_0)
    got = table.rows(ids)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(np.asarray(whole, dtype=np.float32)))


def test_a_float_tables_rows_are_its_values():
    data = np.arange(24, dtype=np.float16).reshape(6, 4) / 7
    got = RawTensor("t", "F16", data).rows([4, 1])
    assert torch.equal(got, torch.from_numpy(data[[4, 1]].astype(np.float32)))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_packing_some_tokens_packs_those_tokens_only(dtype):
    x = activations(tokens=5)
    assert pack_tensor(x, dtype, slice(1, 3)) == pack_tensor(x[:, 1:3].clone(), dtype)
