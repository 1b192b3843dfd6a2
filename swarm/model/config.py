"""What a node or client needs to know about a Llama-family model, independent of file format."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's RoPE scaling: low frequencies (wavelengths past `original_max / low`) slowed
    by `factor`, high ones (under `original_max / high`) kept, those between blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    vocab: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position: int
    attention_bias: bool = False
    rope_llama3: Llama3Rope | None = None  # Llama 3.1+ frequency scaling (HF rope_parameters)
    rope_freq_factors: tuple[float, ...] = ()  # divisors of each frequency (GGUF rope_freqs)
    sliding_window: int | None = None  # attention span past which this code is not exact

    def check_span(self, start: int, end: int) -> None:
        from swarm.errors import SpanError

        if not 0 <= start < end <= self.num_layers:
            raise SpanError(
                f"layers {start}:{end} are not a non-empty range inside 0:{self.num_layers}"
                f" of {self.name}"
            )
