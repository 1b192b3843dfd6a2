"""The benchmark's synthetic GGUF writer makes files our loader and gguf's reader accept."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from swarm.model.blocks import Span
from swarm.model.source import open_model
from tests.helpers.scripts import family_plans, synthetic_gguf

# small, but with GQA, two layers and more rows than one generation chunk (vocab 600)
SHAPES = synthetic_gguf.Shapes(
    hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16, vocab=600, layers=2
)


def _block_error_bound(values: np.ndarray, qtype: str) -> np.ndarray:
    """Largest error a block's quantization may make, per element: half a grid step, plus the
    rounding of the block's scale (and minimum) to float16 times the largest value they make."""
    blocks = values.reshape(-1, 32)
    lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    if qtype == "Q4_1":
        step, reach = (hi - lo) / 15, (hi - lo) + np.abs(lo)
    else:
        reach = np.maximum(np.abs(lo), np.abs(hi))
        step = reach / 127
    bound = step / 2 + reach * 2.0**-10 + 1e-7
    return np.broadcast_to(bound, blocks.shape).reshape(values.shape)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_synthetic_gguf_opens_as_a_llama_model_of_the_given_shapes(tmp_path, qtype):
    path = synthetic_gguf.write_synthetic_gguf(tmp_path / f"s.{qtype}.gguf", SHAPES, qtype)
    c = open_model(path).config
    shapes = (c.num_layers, c.hidden, c.intermediate, c.heads, c.kv_heads, c.head_dim, c.vocab)
    assert shapes == (2, 64, 160, 4, 2, 16, 600)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_synthetic_gguf_tensors_dequantize_to_the_written_values(tmp_path, qtype):
    path = synthetic_gguf.write_synthetic_gguf(tmp_path / f"s.{qtype}.gguf", SHAPES, qtype)
    plan = dict(synthetic_gguf.tensor_plan(SHAPES))
    reader = gguf.GGUFReader(str(path))
    assert {t.name for t in reader.tensors} == set(plan)
    for t in reader.tensors:
        written = synthetic_gguf.synthetic_tensor(t.name, plan[t.name])
        read = gguf.dequantize(t.data, t.tensor_type)
        assert read.shape == written.shape, t.name
        if written.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(read, written)
        else:
            assert t.tensor_type.name == qtype, t.name
            assert np.all(np.abs(read - written) <= _block_error_bound(written, qtype)), t.name
            # and the values are the random ones, not a constant the bound would also accept
            assert np.corrcoef(read.ravel(), written.ravel())[0, 1] > 0.98, t.name


# the benchmark's per-family plans (scripts/bench/family_plans.py), 8 times narrower (gpt-oss
# 10), Q8_0 (gpt-oss its own)
FAMILY_OF_PLAN = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "deepseek_v3": "deepseek_v3",
    "qwen3_5": "qwen3_5",
    "gpt_oss": "gpt_oss",
    "gemma4": "gemma4",
}


def _small_plan(name: str):
    make = family_plans.PLANS[name]
    return make(make(1).sizes[1], shrink=10 if name == "gpt_oss" else 8)  # 2880 / 10: Q8_0's


def test_every_family_plan_is_checked_here():
    assert set(family_plans.PLANS) == set(FAMILY_OF_PLAN)


@pytest.mark.parametrize("plan_name", sorted(FAMILY_OF_PLAN))
def test_family_plan_loads_as_its_family_and_its_timed_layer_decodes(tmp_path, plan_name):
    plan = _small_plan(plan_name)
    qtype = None if plan_name == "gpt_oss" else "Q8_0"  # its own: MXFP4 experts, Q8_0 the rest
    path = synthetic_gguf.write_plan(tmp_path / f"{plan_name}.gguf", plan, qtype=qtype)
    source = open_model(path)
    c = source.config
    assert (c.family, c.num_layers) == (FAMILY_OF_PLAN[plan_name], plan.fields["block_count"])
    last = c.num_layers - 1
    span = Span.load(source, last, last + 1)
    caches = [span.allocate_cache(last, last + 1, 4) for _ in range(2)]
    ids = None if span.per_layer is None else [5, 6]  # Gemma 4's per-layer inputs need them
    out = span.decode(torch.randn(2, c.hidden) * 0.1, caches, [0, 0], last, last + 1, ids)
    assert out.shape == (2, c.hidden) and bool(torch.isfinite(out).all())


def test_gpt_oss_plan_holds_its_experts_as_mxfp4_and_the_rest_as_planned(tmp_path):
    plan = _small_plan("gpt_oss")
    reader = gguf.GGUFReader(str(synthetic_gguf.write_plan(tmp_path / "g.gguf", plan)))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds == {name: kind for name, _, kind in plan.tensors}
    assert kinds["blk.1.ffn_down_exps.weight"] == "MXFP4"
    assert reader.fields["general.architecture"].contents() == "gpt-oss"
