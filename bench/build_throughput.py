"""Dataset builds against the backend's own plain prefill of the same prompts (issue 23).

    .venv/bin/python bench/build_throughput.py [--parts vllm eager cluster write rss] [--prompts 256]
        [--reps 3] [--layer 15] [--rss-sizes 1000 10000] [--json out.json]

SmolLM2-135M (the embedded model), ``--prompts`` prompts of 40-100 words, ``resid_post.<layer>``
in the token layout, bf16, shards of 64. Each part alternates its variants in one process
(``bench/timing.py``'s ``alternate``: every repetition runs each once, in a shuffled order) and
reports tokens/s, the ratios to the plain prefill (of the medians, paired, fastest) and where the
build's time went (capture, encode, hash, write, waiting: seconds summed over shards, which
overlap). ``/proc/loadavg`` is printed before and after each part.

- ``vllm``: ``plain`` = ``LLM.generate(max_tokens=1)`` on the model's own engine;
  ``plain_short`` = the same with the engine running layers ``0..layer`` only (what a shortened
  build runs); ``build`` (shortened: the deepest point is ``layer``); ``build_full`` (the same
  build with shortening off).
- ``eager``: ``plain`` = the Hugging Face model's decoder over layers ``0..layer`` on the very
  padded batches the build forms (``plan_batches``), no hooks; ``build``.
- ``cluster``: a 1-replica vLLM cluster build against the local engine's ``plain`` (and the local
  ``build``).
- ``write``: the write path alone on a synthetic 4096-wide bf16 residual (shards of 64 prompts x
  128 tokens): CPU seconds per MiB of activations for building the Arrow table and encoding
  Parquet, sha256, and publishing it to the local disk and to a local S3 server (``moto_server``),
  and the tokens/s one writer sustains.
- ``rss``: peak resident memory of a local vLLM build of ``--rss-sizes`` prompts (default 1,000
  and 10,000; short prompts of 6-15 words, so the large build takes minutes), each size in a
  fresh process: the high-water mark (``VmHWM``) of that process and of every process under it
  (an engine-core process, where vLLM runs one; vLLM 0.32's CPU engine runs in the process
  itself), read while they are alive; the ratio of the sums, largest / smallest.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from timing import alternate, fastest, median, paired, ratio  # noqa: E402

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WORDS = "the of and a to in is was he for it with as his on be at by had are but from or have an they".split()


def prompts(n: int) -> list[str]:
    """``n`` prompts of 40-100 words."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40 + (i * 37) % 61)) for i in range(n)]


def short_prompts(n: int) -> list[str]:
    """``n`` prompts of 6-15 words (the memory part)."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 10)) for i in range(n)]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def builder(model, texts, points, work: Path, record: dict):
    from interp_engine import build_dataset

    def run():
        out = work / uuid.uuid4().hex[:8]
        ds = build_dataset(model, texts, points, out, layout="token", dtype="bfloat16", shard_size=64, progress=False)
        record["phases"] = ds.phases
        shutil.rmtree(out, ignore_errors=True)
        return ds.tokens
    return run


def plain_prefill(model, texts):
    """(a call of the vLLM engine's own ``generate(max_tokens=1)`` on ``texts``, their token count):
    the plain prefill a build is measured against."""
    from vllm import SamplingParams

    rows = [{"prompt_token_ids": model.tok.encode(t)} for t in texts]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    return (lambda: model.llm.generate(rows, params, use_tqdm=False)), sum(len(r["prompt_token_ids"]) for r in rows)


def report(name: str, wall, cpu, tokens: int, base: str, phases: dict | None = None) -> dict:
    out = {"tokens": tokens, "tokens_per_s": {k: tokens / median(v) for k, v in wall.items()},
           "median_s": {k: median(v) for k, v in wall.items()}, "cpu_median_s": {k: median(v) for k, v in cpu.items()},
           "vs_" + base: {k: {"median": ratio(wall, k, base), "paired": paired(wall, k, base),
                              "fastest": fastest(wall, k, base)} for k in wall if k != base}}
    if phases:
        out["build_phases_s"] = phases
    print(f"[{name}] " + json.dumps(out, indent=1), flush=True)
    return out


def part_vllm(args, texts, work) -> dict:
    from interp_engine import load_model

    model = load_model(SMOL, backend="vllm")
    plain, tokens = plain_prefill(model, texts)
    point = [f"resid_post.{args.layer}"]
    record: dict = {}

    def plain_short():  # the engine idle between calls: its loop thread touches nothing meanwhile
        model.llm.llm_engine.collective_rpc("interp_set_depth", args=(args.layer + 1,))
        try:
            return plain()
        finally:
            model.llm.llm_engine.collective_rpc("interp_set_depth", args=(None,))

    build = builder(model, texts, point, work, record)
    full_record: dict = {}
    build_full_inner = builder(model, texts, point, work, full_record)

    def build_full():
        model.shortens = False
        try:
            return build_full_inner()
        finally:
            model.shortens = True

    runs = {"plain": plain, "plain_short": plain_short, "build": build, "build_full": build_full}
    wall, cpu = alternate(runs, args.reps, 1)
    out = report("vllm", wall, cpu, tokens, "plain", record.get("phases"))
    out["build_full_phases_s"] = full_record.get("phases")
    out["build_vs_plain_short"] = {"median": ratio(wall, "build", "plain_short"),
                                   "paired": paired(wall, "build", "plain_short")}
    model.close()
    return out


@contextlib.contextmanager
def first_layers(hf, n: int):
    """The Hugging Face model with only its first ``n`` decoder layers (restored after)."""
    import torch

    layers = hf.model.layers
    hf.model.layers = torch.nn.ModuleList(list(layers)[:n])
    try:
        yield hf.model
    finally:
        hf.model.layers = layers


def part_eager(args, texts, work) -> dict:
    import torch

    from interp_engine import load_model
    from interp_engine.batching import plan_batches
    from interp_engine.dataset.shard import BATCH_TOKENS
    from interp_engine.tokens import pad_batch

    model = load_model(SMOL)
    encoded = [model.tok.encode(t) for t in texts]
    tokens = sum(map(len, encoded))
    batches = []
    for s in range(0, len(encoded), 64):
        shard = encoded[s:s + 64]
        for batch in plan_batches([len(r) for r in shard], BATCH_TOKENS):
            ids = pad_batch([shard[i] for i in batch])
            batches.append((ids.clamp(min=0), ids >= 0))
    record: dict = {}

    def plain():
        with torch.inference_mode(), first_layers(model.hf, args.layer + 1) as decoder:
            for ids, mask in batches:
                decoder(input_ids=ids, attention_mask=mask, use_cache=False)

    runs = {"plain": plain, "build": builder(model, texts, [f"resid_post.{args.layer}"], work, record)}
    wall, cpu = alternate(runs, args.reps, 1)
    out = report("eager", wall, cpu, tokens, "plain", record.get("phases"))
    out["batches"] = len(batches)
    out["padding"] = 1 - tokens / sum(int(ids.numel()) for ids, _ in batches)
    return out


def part_cluster(args, texts, work) -> dict:
    import ray

    from interp_engine import load_model
    from interp_engine.loopback import start_local_ray

    start_local_ray(num_cpus=2)  # loopback only, token auth: the library's own local Ray
    try:
        cluster = load_model(SMOL, backend="vllm", replicas=1, cpus_per_replica=1)
        local = load_model(SMOL, backend="vllm")
        plain, tokens = plain_prefill(local, texts)
        point = [f"resid_post.{args.layer}"]
        record: dict = {}
        runs = {"plain": plain,
                "local_build": builder(local, texts, point, work, {}),
                "cluster_build": builder(cluster, texts, point, work, record)}
        wall, cpu = alternate(runs, args.reps, 1)
        out = report("cluster", wall, cpu, tokens, "plain", record.get("phases"))
        out["cluster_vs_local_build"] = {"median": ratio(wall, "cluster_build", "local_build"),
                                         "paired": paired(wall, "cluster_build", "local_build")}
        cluster.close()
        local.close()
    finally:
        ray.shutdown()
    return out


def part_write(args, work) -> dict:
    """CPU seconds per MiB of the write path on a synthetic 4096-wide bf16 residual."""
    import torch

    from interp_engine.address import Address
    from interp_engine.cache import Cache
    from interp_engine.dataset.shard import Captured, ShardSpec, shard_bytes, shard_table
    from interp_engine.dataset.store import Store

    sys.path.insert(0, str(Path(__file__).parents[1]))
    prompts_, length, width = 64, 128, 4096
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (prompts_, length))
    resid = (torch.randn(prompts_, length, width) * 4).to(torch.bfloat16)
    cache = Cache({Address("resid_post", 15): resid}, tokens, None, "synthetic", "eager")
    raw_mib = resid.numel() * 2 / 2**20
    stores = {"disk": Store.of(work / "write")}
    s3 = None
    try:
        from tests import s3server

        s3 = s3server.start()
        fs = s3.filesystem()
        fs.create_dir("bench")
        stores["s3"] = Store.of((fs, "bench/write"))
    except Exception as err:  # noqa: BLE001 - the S3 server is optional for this part
        print(f"no local S3 server ({err}); disk only", flush=True)
    out = {"raw_mib_per_shard": raw_mib, "tokens_per_shard": prompts_ * length, "d_model": width}
    try:
        for label, store in stores.items():
            store.make_root()
            spec = ShardSpec(store, ("resid_post.15",), "token", "bfloat16", length, 1000, prompts_, "{}")
            cpu = {"encode": [], "hash": [], "write": []}
            for i in range(args.reps + 1):
                captured = Captured(i, tokens, cache, torch.arange(prompts_))
                c0 = time.process_time()
                data = shard_bytes(shard_table(spec, captured)[0])
                c1 = time.process_time()
                hashlib.sha256(data).hexdigest()
                c2 = time.process_time()
                store.write(spec.name(i), data)
                c3 = time.process_time()
                if i:  # the first is a warm-up
                    for key, seconds in zip(cpu, (c1 - c0, c2 - c1, c3 - c2)):
                        cpu[key].append(seconds)
            per_mib = {k: median(v) / raw_mib for k, v in cpu.items()}
            total = sum(per_mib.values())
            out[label] = {"cpu_s_per_mib": per_mib, "cpu_s_per_mib_total": total,
                          "file_mib": len(data) / 2**20,
                          "one_writer_tokens_per_s": 1 / (total * width * 2 / 2**20)}
            print(f"[write {label}] " + json.dumps(out[label]), flush=True)
    finally:
        if s3 is not None:
            s3.stop()
    return out


def rss_child(args) -> None:
    """One local vLLM build of ``args.rss_child`` prompts; prints its peak memory as JSON."""
    import psutil

    from interp_engine import build_dataset, load_model
    from rss import peak_rss_mb

    model = load_model(SMOL, backend="vllm")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ds = build_dataset(model, short_prompts(args.rss_child), [f"resid_post.{args.layer}"], Path(tmp) / "d",
                           layout="token", dtype="bfloat16", shard_size=64, progress=False)
        seconds = time.perf_counter() - start
        procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
        peaks = {p.pid: peak_rss_mb(p.pid) for p in procs}
        print(json.dumps({"prompts": args.rss_child, "rows": ds.rows, "tokens": ds.tokens, "seconds": seconds,
                          "peak_mb": peaks, "peak_mb_total": sum(peaks.values())}), flush=True)
    model.close()


def part_rss(args) -> dict:
    out = {"sizes": {}}
    for n in sorted(args.rss_sizes):
        command = [sys.executable, __file__, "--rss-child", str(n), "--layer", str(args.layer)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        out["sizes"][n] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"[rss {n}] " + json.dumps(out["sizes"][n]), flush=True)
    small, large = out["sizes"][min(args.rss_sizes)], out["sizes"][max(args.rss_sizes)]
    out["large_over_small"] = large["peak_mb_total"] / small["peak_mb_total"]
    print(f"[rss] peak RSS {large['prompts']} / {small['prompts']} prompts: {out['large_over_small']:.3f} "
          f"({large['peak_mb_total']:.0f} / {small['peak_mb_total']:.0f} MiB)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["vllm", "eager", "cluster", "write", "rss"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--rss-sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--json", default="")
    parser.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args)
        return
    texts = prompts(args.prompts)
    results = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for part in args.parts:
            before = loadavg()
            print(f"== {part} (loadavg {before})", flush=True)
            if part in ("write", "rss"):
                results[part] = part_write(args, work) if part == "write" else part_rss(args)
            else:
                run = {"vllm": part_vllm, "eager": part_eager, "cluster": part_cluster}[part]
                results[part] = run(args, texts, work)
            results[part]["loadavg"] = {"before": before, "after": loadavg()}
            print(f"== {part} done (loadavg {results[part]['loadavg']['after']})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
