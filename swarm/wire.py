"""Sans-IO wire codec: 4-byte big-endian length prefix, then one msgpack map.

Tensors travel as {"dtype", "shape", "data"}; the receiver checks all three against what the
place they were sent to expects before any byte becomes a tensor.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import torch

from swarm.errors import FrameTooLarge, ProtocolError, ShapeMismatch

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
FRAME_PREFIX = struct.Struct(">I")  # a frame: its body's length, then the body

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
_NUMPY = {"float16": np.float16, "float32": np.float32}
# what nodes and clients send unless told otherwise: half float32's bytes, and the default
# model's greedy tokens through a swarm still agree with float32's (tests/test_swarm_default.py)
DEFAULT_WIRE_DTYPE = "float16"


def encode_frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return FRAME_PREFIX.pack(len(body)) + body


class FrameDecoder:
    """Feed bytes in, take whole messages out. Refuses a frame as soon as its prefix is too big."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self._buffer = bytearray()
        self.last_frame_bytes = 0  # size, prefix included, of the frame next_message returned

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= FRAME_PREFIX.size:
            (length,) = FRAME_PREFIX.unpack_from(self._buffer)
            if length > self.max_frame:
                raise FrameTooLarge(
                    f"frame of {length} bytes exceeds the limit of {self.max_frame} bytes"
                )

    def next_message(self) -> dict[str, Any] | None:
        if len(self._buffer) < FRAME_PREFIX.size:
            return None
        (length,) = FRAME_PREFIX.unpack_from(self._buffer)
        if length > self.max_frame:
            raise FrameTooLarge(f"frame of {length} bytes exceeds the limit of {self.max_frame}")
        end = FRAME_PREFIX.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[FRAME_PREFIX.size : end])
        del self._buffer[:end]
        self.last_frame_bytes = end
        try:
            message = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise ProtocolError(f"frame is not valid msgpack: {type(exc).__name__}") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"frame must hold a map, got {type(message).__name__}")
        return message


def pack_tensor(
    tensor: torch.Tensor, wire_dtype: str, tokens: slice | None = None
) -> dict[str, Any]:
    """`tensor` [1, tokens, hidden] (`tokens`: those of its tokens only) for the wire."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; choose from {sorted(WIRE_DTYPES)}")
    if wire_dtype != "bfloat16" and tensor.dtype == torch.float32:
        # numpy's cast (IEEE round to nearest even, as torch's): a step's activations are
        # packed on the node's event loop between compute passes, where each torch call
        # costs ~30-40 us with its code out of the caches and numpy's ~5x less
        arr = tensor.detach().numpy()
        with np.errstate(over="ignore"):  # past float16's range: inf, as torch gives, unsaid
            arr = (arr if tokens is None else arr[:, tokens]).astype(_NUMPY[wire_dtype])
        return {"dtype": wire_dtype, "shape": list(arr.shape), "data": arr.tobytes()}
    t = tensor.detach() if tokens is None else tensor.detach()[:, tokens]
    t = t.to(WIRE_DTYPES[wire_dtype]).contiguous()
    # numpy has no bfloat16: ship its raw 16-bit pattern
    raw = t.view(torch.int16) if wire_dtype == "bfloat16" else t
    return {"dtype": wire_dtype, "shape": list(t.shape), "data": raw.numpy().tobytes()}


def unpack_tensor(
    obj: Any, *, hidden: int, max_tokens: int, tokens: int | None = None, native: bool = False
) -> torch.Tensor:
    """Decode a [1, tokens, hidden] activation, checking dtype, shape and byte count; as
    float32, or (`native`) in the dtype it came in."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise ShapeMismatch("tensor must be a map with exactly dtype, shape and data")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ShapeMismatch(
            f"unsupported tensor dtype {dtype!r}; expected one of {sorted(WIRE_DTYPES)}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise ShapeMismatch(f"tensor shape must be [1, tokens, hidden], got {shape!r}")
    if shape[0] != 1 or shape[2] != hidden or not 1 <= shape[1] <= max_tokens:
        raise ShapeMismatch(
            f"tensor shape {shape} does not fit [1, 1..{max_tokens}, {hidden}] expected here"
        )
    if tokens is not None and shape[1] != tokens:
        raise ShapeMismatch(f"tensor carries {shape[1]} tokens but the step declares {tokens}")
    if not isinstance(data, bytes) or len(data) != shape[1] * hidden * _ITEMSIZE[dtype]:
        raise ShapeMismatch(
            f"tensor data is {len(data) if isinstance(data, bytes) else type(data).__name__}"
            f" bytes, shape {shape} of {dtype} needs {shape[1] * hidden * _ITEMSIZE[dtype]}"
        )
    # numpy only (see pack_tensor): bfloat16 widens exactly by its 16 bits shifted up, as
    # torch widens it; then the largest magnitude, which is NaN or infinite where any value is
    bf16 = dtype == "bfloat16"
    arr = np.frombuffer(data, dtype=np.int16 if bf16 else _NUMPY[dtype]).reshape(shape)
    values = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if bf16 else arr
    if not native and not bf16:
        values = arr.astype(np.float32)  # a copy: the frame's bytes are not the tensor's
    if not np.isfinite(np.abs(values).max()):
        raise ShapeMismatch("tensor holds NaN or Inf values")
    if native:
        t = torch.from_numpy(arr.copy())
        return t.view(torch.bfloat16) if bf16 else t
    return torch.from_numpy(values)


def tensor_nbytes(tokens: int, hidden: int, wire_dtype: str) -> int:
    return tokens * hidden * _ITEMSIZE[wire_dtype]
