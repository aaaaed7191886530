"""vLLM's model inspection, for every architecture the suite starts, in one process.

The first time vLLM meets a model class it inspects it (does it take multimodal input, pooling,
...) in a fresh subprocess that imports vLLM anew (about 14 s on the 2-core machines, per class),
and keeps the answer in ``$VLLM_CACHE_ROOT/modelinfos`` keyed by a hash of the class's source. On a
fresh machine the suite would pay that once per family. ``python -m tests.vllm_warm`` pays the
import once and writes the same cache entries, with vLLM's own code: conftest starts it in the
background when the session begins, so the first engines of each family find the answer waiting.
It changes nothing an engine computes; an engine that starts before it is done inspects as usual.
"""

from __future__ import annotations

import sys

# the architectures of the tiny fixtures (tests/tiny*.py) and the vLLM family tests
ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
    "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM", "GPT2LMHeadModel",
    "GptOssForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen3MoeForCausalLM",
    "TransformersForCausalLM", "DeepseekV3ForCausalLM", "Qwen3_5ForCausalLM",
)


def main() -> int:
    import importlib.util
    from pathlib import Path

    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel, _ModelInfo

    for arch in ARCHITECTURES:
        entry = ModelRegistry.models.get(arch)
        if not isinstance(entry, _LazyRegisteredModel):
            continue
        try:
            source = Path(importlib.util.find_spec(entry.module_name).origin)
            digest = entry._get_modelinfo_module_hash(source)
            if entry._load_modelinfo_from_cache(digest) is None:
                entry._save_modelinfo_to_cache(_ModelInfo.from_model_cls(entry.load_model_cls()), digest)
        except Exception as error:  # a class this vLLM cannot import: its engine test says why
            print(f"vllm_warm: {arch}: {type(error).__name__}: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
