"""Weight codes and scales: GGUF's 4-bit blocks read as they are, and quantizers for the rest.

torch's int4 CPU kernel computes `w = (q - 8) * scale + zero` over groups of 32 inputs. GGUF's
Q4_0, Q4_1 and Q4_K store every 32 inputs as 4-bit codes with one scale and one offset
(`w = q * scale + offset`), so their codes carry over unchanged: zero = offset + 8 * scale. Only
the scale and zero are rounded, to bfloat16, because the kernel takes them in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # inputs per int4 scale group; GGUF's 4-bit blocks and sub-blocks are this size


@dataclass
class Int4Groups:
    """4-bit codes [rows, cols] in 0..15 with, per group of 32 columns, `w = q * scale + offset`."""

    codes: np.ndarray  # uint8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols / 32]
    offset: np.ndarray  # float32 [rows, cols / 32]

    FIELDS = ("codes", "scale", "offset")

    def dequantize(self) -> np.ndarray:
        rows, cols = self.codes.shape
        q = self.codes.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
        return (q * self.scale[..., None] + self.offset[..., None]).reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per entry along the last axis -> float32 of the little-endian float16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF packs 32 codes in 16 bytes: low nibbles are codes 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> Int4Groups:
    d = _f16(b[..., 0:2])
    return Int4Groups(_nibbles(b[..., 2:]), d, -8.0 * d)


def _q4_1(b: np.ndarray) -> Int4Groups:
    return Int4Groups(_nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _q4_k(b: np.ndarray) -> Int4Groups:
    # a 256-element super-block: float16 d and dmin, eight 6-bit (scale, min) pairs packed in
    # 12 bytes, then 128 bytes of codes in four 64-element runs (low nibbles, then high)
    d, dmin, sc, qs = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16], b[..., 16:]
    scales = np.concatenate(
        [sc[..., 0:4] & 63, (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)], axis=-1
    ).astype(np.float32)
    mins = np.concatenate(
        [sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1
    ).astype(np.float32)
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    codes = np.stack([runs & 0xF, runs >> 4], axis=-2)  # [..., run, low/high, 32]
    return Int4Groups(
        codes.reshape(*qs.shape[:-1], 256),
        (d[..., None] * scales),
        (-dmin[..., None] * mins),
    )


# GGUF type name -> (bytes per block, elements per block, decoder)
_DECODERS = {"Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1), "Q4_K": (144, 256, _q4_k)}
INT4_NATIVE = tuple(_DECODERS)


def gguf_int4(raw: np.ndarray, type_name: str) -> Int4Groups:
    """The codes, scales and offsets of a 2-D GGUF Q4_0/Q4_1/Q4_K tensor, read as they are.

    `raw` is gguf's view of the tensor: uint8 [rows, bytes per row]."""
    block_bytes, block_elems, decode = _DECODERS[type_name]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)
    g = decode(blocks)
    cols = blocks.shape[1] * block_elems
    return Int4Groups(
        g.codes.reshape(rows, cols), g.scale.reshape(rows, -1), g.offset.reshape(rows, -1)
    )


def quantize_int4(w: np.ndarray) -> Int4Groups:
    """Round-to-nearest asymmetric 4-bit codes over groups of 32 inputs (min..max per group)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
    lo, hi = g.min(-1), g.max(-1)
    scale = _bf16_round(np.maximum(hi - lo, 1e-12) / 15.0)
    zero = _bf16_round(lo + 8.0 * scale)  # round as the kernel will hold them, then fit codes
    codes = np.clip(np.rint((g - zero[..., None]) / scale[..., None]) + 8, 0, 15)
    return Int4Groups(codes.astype(np.uint8).reshape(rows, cols), scale, zero - 8.0 * scale)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().float().numpy()


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes per output row: (codes int8 [rows, cols], scales float32 [rows])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    scale = scale.bfloat16().float()  # the kernel holds scales in bfloat16: fit codes to that
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale
