"""How much memory a vLLM engine reserves on CPU when the caller chooses nothing, and the error
when it cannot reserve it (vLLM's own default, 0.92 of the host's RAM, fails beside other work)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import EngineMemoryError, ModelInfo, load_model
from interp_engine.backends.vllm.engine import (
    DEFAULT_CAP,
    DEFAULT_FLOOR,
    GiB,
    cpu_kv_cache_bytes,
    kv_bytes_per_token,
    memory_defaults,
)

#: SmolLM2-135M's geometry (30 layers, 3 kv heads of 64, 8,192 positions)
SMOLLM2 = ModelInfo("smollm2", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_head=64, d_mlp=1536,
                    d_vocab=49152, n_ctx=8192)


def test_the_default_holds_eight_full_sequences_within_the_caps():
    per_token = kv_bytes_per_token(SMOLLM2, torch.float32)
    assert per_token == 2 * 30 * 3 * 64 * 4
    plenty = 64 * GiB
    assert cpu_kv_cache_bytes(SMOLLM2, torch.float32, 8192, available=plenty) == 8 * per_token * 8192  # 2.8 GiB
    assert cpu_kv_cache_bytes(SMOLLM2, torch.bfloat16, 8192, available=plenty) == 8 * per_token // 2 * 8192
    # a quarter of the free memory caps it, but one full sequence always fits
    assert cpu_kv_cache_bytes(SMOLLM2, torch.float32, 8192, available=4 * GiB) == GiB
    assert cpu_kv_cache_bytes(SMOLLM2, torch.float32, 128, available=plenty) == DEFAULT_FLOOR
    big = ModelInfo("big", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_head=128, d_mlp=1,
                    d_vocab=1, n_ctx=32768)
    assert cpu_kv_cache_bytes(big, torch.bfloat16, 4096, available=plenty) == DEFAULT_CAP  # 8 x 1.25 GiB, capped
    # tensor parallelism: each rank holds its share of the kv heads
    assert kv_bytes_per_token(big, torch.bfloat16, 2) == kv_bytes_per_token(big, torch.bfloat16) // 2
    assert cpu_kv_cache_bytes(big, torch.bfloat16, 1024, 2, available=plenty) == 8 * 1024 * 2 * 80 * 4 * 128 * 2


def test_a_sequence_that_cannot_fit_is_an_error_that_says_what_to_set():
    with pytest.raises(EngineMemoryError, match=r"needs 0\.35 GiB.*max_model_len=N.*VLLM_CPU_KVCACHE_SPACE"):
        cpu_kv_cache_bytes(SMOLLM2, torch.float32, 8192, available=GiB)
    big = ModelInfo("big", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_head=128, d_mlp=1,
                    d_vocab=1, n_ctx=32768)
    with pytest.raises(EngineMemoryError, match=r"needs 10\.00 GiB.*at most 4 GiB"):
        cpu_kv_cache_bytes(big, torch.bfloat16, 32768, available=64 * GiB)


def test_a_caller_choice_is_left_alone(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert memory_defaults(SMOLLM2, torch.float32, 256, 1, {"gpu_memory_utilization": 0.5}) == {}
    assert memory_defaults(SMOLLM2, torch.float32, 256, 1, {"kv_cache_memory_bytes": 1 << 28}) == {}
    assert memory_defaults(SMOLLM2, torch.float32, 128, 1, {}) == {"kv_cache_memory_bytes": DEFAULT_FLOOR}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert memory_defaults(SMOLLM2, torch.float32, 256, 1, {}) == {}


def test_vllms_own_fraction_of_ram_fails_with_an_error_that_says_what_to_set(tiny_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(EngineMemoryError, match=r"could not reserve its memory.*VLLM_CPU_KVCACHE_SPACE=<GiB>.*"
                                                r"kv_cache_memory_bytes"):
        load_model(str(tiny_path("llama")), backend="vllm", max_model_len=64, gpu_memory_utilization=0.999)
