"""Eager capture on a GPU: what capturing, generating with capture and editing cost beside the
model's own plain work, measured side by side in one process.

A randomly initialised model of Llama-3-8B's shape (32 layers, d_model 4096, 32 heads / 8 KV
heads, d_mlp 14336, vocab 128256; no download: the shape is the config) in bf16 on one GPU.
Each variant is timed with the GPU synchronised before and after (so a time is the whole
GPU work of the call), every repetition runs every variant once in a shuffled order
(``bench/timing.py``), and the report gives medians and ratios to the plain variant beside it:

- ``plain`` (``hf(input_ids)``, all logits) vs ``resid_post`` (every layer, target <= 1.05x),
  ``resid_post_last`` (the same at the last position only, ``positions=-1``) and ``dense`` (every
  dense site at every layer + logits, target <= 1.25x), batch 8 x 1024;
- ``generate`` (``hf.generate``, greedy, 64 new tokens) vs ``capture_generation`` of
  ``resid_post`` at every layer (target <= 1.10x);
- ``no_edit`` vs ``add_every_layer`` (an ``Add`` on ``resid_post`` of every layer).

Beside the times: the peak GPU memory of each variant, and the number of host-device
synchronisations one capture makes (counted with ``torch.cuda.set_sync_debug_mode``): a capture
that reads back a value per hook would show one per hook.

    python bench/gpu/speed.py --device cuda --out results/   # the GPU run (bench/gpu/check.sh)
    python bench/gpu/speed.py --device cpu --tiny            # a smoke run of the same code
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/timing.py
from timing import alternate, fastest, median, paired, ratio  # noqa: E402

from interp_engine import Add, Address, capture_generation, run_with_cache  # noqa: E402
from interp_engine.backends.eager.model import EagerModel  # noqa: E402

DENSE_SITES = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "q", "k", "v", "mlp_post"]
TARGETS = {"resid_post": ("plain", 1.05), "dense": ("plain", 1.25), "capture_generation": ("generate", 1.10)}

#: Llama-3-8B's shape; ``--tiny`` keeps the family and shrinks everything
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def word_tokenizer(vocab_size: int):
    """A tokenizer with one made-up word per id (``t0`` .. ``tN``): random ids decode to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="t0", bos_token="t1", eos_token="t2")


def random_model(shape: dict, device: str, dtype: torch.dtype) -> EagerModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: no fp32 copy of 8B weights on the way
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return EagerModel(hf, word_tokenizer(config.vocab_size), "random-llama3-8b-shape")


def synced(device: str, fn):
    """``fn`` timed as GPU work: the device is idle before the call starts and after it returns."""
    def run():
        if device == "cuda":
            torch.cuda.synchronize()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    return run


def peak_memory(device: str, fn) -> float | None:
    """Peak GPU memory (GiB) allocated during one call, above what was held before it."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def count_syncs(device: str, fn) -> int | None:
    """How many host-device synchronisations one call makes (each warns once in sync debug mode)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def variants(model: EagerModel, ids: torch.Tensor, prompt: torch.Tensor, new_tokens: int) -> dict:
    hf, layers = model.hf, range(model.n_layers)
    resid = [Address("resid_post", L) for L in layers]
    dense = [Address(n, L) for n in DENSE_SITES for L in layers] + [Address("logits")]
    last = [Address("resid_post", model.n_layers - 1)]
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    steer = {Address("resid_post", L): Add(vector, scale=0.1) for L in layers}
    on_device = ids.to(model.device)

    def plain():
        with torch.inference_mode():
            return hf(input_ids=on_device).logits

    def generate():
        with torch.inference_mode():
            return hf.generate(prompt.to(model.device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=2)

    return {
        "plain": plain,
        "resid_post": lambda: run_with_cache(model, ids, resid),
        "resid_post_last": lambda: run_with_cache(model, ids, resid, positions=-1),
        "dense": lambda: run_with_cache(model, ids, dense),
        "generate": generate,
        "capture_generation": lambda: capture_generation(model, prompt, resid, max_tokens=new_tokens,
                                                         stop_at_eos=False),
        "no_edit": lambda: run_with_cache(model, ids, last),
        "add_every_layer": lambda: run_with_cache(model, ids, last, edits=steer),
    }


GROUPS = [["plain", "resid_post", "resid_post_last", "dense"], ["generate", "capture_generation"], ["no_edit", "add_every_layer"]]
BASES = {"resid_post": "plain", "resid_post_last": "plain", "dense": "plain", "capture_generation": "generate", "add_every_layer": "no_edit"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (a smoke run)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=128, help="prompt length of the generation variants")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="folder for speed.json")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq, args.prompt, args.new_tokens, args.reps, args.warmup = 2, 32, 8, 4, 2, 1
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False

    model = random_model(TINY if args.tiny else LLAMA3_8B, args.device, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.info.d_vocab, (args.batch, args.seq), generator=g)
    prompt = torch.randint(3, model.info.d_vocab, (1, args.prompt), generator=g)
    runs = variants(model, ids, prompt, args.new_tokens)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{model.name} ({'tiny' if args.tiny else 'Llama-3-8B shape'}), bf16 on {name}: batch {args.batch} x "
          f"{args.seq}, generation {args.prompt} + {args.new_tokens} tokens, torch {torch.__version__}, "
          f"{args.reps} reps (+{args.warmup} warm-up)", flush=True)

    wall, _ = alternate({k: synced(args.device, f) for k, f in runs.items()}, args.reps, args.warmup, groups=GROUPS)
    memory = {k: peak_memory(args.device, f) for k, f in runs.items()}
    syncs = {k: count_syncs(args.device, f) for k, f in runs.items()}
    result = {
        "device": name, "torch": torch.__version__, "shape": "tiny" if args.tiny else "llama3-8b",
        "batch": args.batch, "seq": args.seq, "prompt": args.prompt, "new_tokens": args.new_tokens,
        "reps": args.reps, "median_s": {k: median(v) for k, v in wall.items()},
        "ratio": {k: ratio(wall, k, b) for k, b in BASES.items()},
        "paired": {k: paired(wall, k, b) for k, b in BASES.items()},
        "fastest": {k: fastest(wall, k, b) for k, b in BASES.items()},
        "peak_gib": memory, "syncs": syncs,
    }
    report(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "speed.json").write_text(json.dumps(result, indent=1))
    return result


def report(result: dict) -> None:
    print("\n| variant | median s | vs | ratio of medians | paired ratio | fastest ratio | target | peak GiB | syncs |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for k, t in result["median_s"].items():
        base = BASES.get(k, "")
        target = f"<= {TARGETS[k][1]:.2f}x" if k in TARGETS else ""
        r = f"{result['ratio'][k]:.3f}x" if base else ""
        p = f"{result['paired'][k]:.3f}x" if base else ""
        f = f"{result['fastest'][k]:.3f}x" if base else ""
        mem = result["peak_gib"][k]
        print(f"| {k} | {t:.4f} | {base} | {r} | {p} | {f} | {target} | {'' if mem is None else f'{mem:.2f}'} "
              f"| {'' if result['syncs'].get(k) is None else result['syncs'][k]} |")


if __name__ == "__main__":
    main()
