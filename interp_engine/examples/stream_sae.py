"""Train a TopK SAE from an activation stream, no dataset on disk, and save it with save_dictionary.

``python -m interp_engine.examples.stream_sae --replicas 2 --tokens 4096`` streams ``resid_post.15``
of the embedded SmolLM2 from two replicas (a local Ray cluster; ``--replicas 0``: the model in
this process) into SAELens's ``SAETrainer`` and writes the SAE to ``--output`` as a SAELens 6
folder that ``load_dictionary`` and ``sae_lens.SAE.load_from_disk`` both read.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

TOPICS = ["the river", "a small bakery", "the old library", "our new train line", "the winter market",
          "a chess club", "the harbour", "the mountain road", "a school garden", "the night shift"]


def prompts(n: int) -> list[str]:
    """``n`` short varied English prompts (no download)."""
    verbs = ["opened", "closed", "changed", "grew", "moved"]
    return [f"Yesterday {TOPICS[i % len(TOPICS)]} {verbs[i % len(verbs)]} again, and people said it was "
            f"{'better' if i % 3 else 'strange'} than last year because of {TOPICS[(i * 7) % len(TOPICS)]}."
            for i in range(n)]


def train_sae(model, texts: list[str], point: str, output, *, tokens: int, d_sae: int, k: int,
              batch_tokens: int = 256, shuffle_buffer: int = 2048, seed: int = 0, lr: float = 4e-4,
              progress: bool = True):
    """Train a TopK SAE on ``point`` from a stream over ``texts`` for ``tokens`` rows; save it
    under ``output`` with ``save_dictionary`` and return the saved :class:`Dictionary`."""
    import torch
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.training.sae_trainer import SAETrainer

    from interp_engine import activation_stream, load_dictionary, parse_address, save_dictionary
    from interp_engine.stream.saelens import SAELensActivations

    torch.manual_seed(seed)
    address = parse_address(point)
    stream = activation_stream(model, texts, [point], batch_tokens=batch_tokens, shuffle_buffer=shuffle_buffer,
                               seed=seed, epochs=1 << 20, progress=progress)
    provider = SAELensActivations(stream)
    first = provider.next_batch()  # the width, and a batch the trainer does not miss much
    cfg = TopKTrainingSAEConfig(d_in=first.shape[1], d_sae=d_sae, k=k, metadata=SAEMetadata(hook_name=point))
    sae = TopKTrainingSAE(cfg)
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=tokens, train_batch_size_samples=batch_tokens,
                                          lr=lr, lr_end=lr, logger=LoggingConfig(log_to_wandb=False),
                                          n_batches_for_norm_estimate=1, feature_sampling_window=1000),
                         sae, provider)
    trainer.fit()
    with tempfile.TemporaryDirectory() as tmp:
        sae.save_inference_model(tmp)  # SAELens's own maths, read back as a dictionary of ours
        dictionary = load_dictionary(tmp, reads=address)
    save_dictionary(dictionary, output)
    return dictionary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="replicas on a local Ray cluster (0: this process)")
    parser.add_argument("--tokens", type=int, default=4096, help="rows (tokens) to train on")
    parser.add_argument("--point", default="resid_post.15")
    parser.add_argument("--d-sae", type=int, default=1152)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--output", default="/tmp/interp_engine-examples/stream-sae")
    args = parser.parse_args(argv)

    from interp_engine import load_model
    from interp_engine.embedded import NAME

    kwargs = {} if args.replicas == 0 else {"replicas": args.replicas, "torch_threads": 1}
    model = load_model(NAME, **kwargs)
    try:
        d = train_sae(model, prompts(max(16, args.tokens // 24)), args.point, Path(args.output), tokens=args.tokens,
                      d_sae=args.d_sae, k=args.k)
    finally:
        getattr(model, "close", lambda: None)()
    print(f"saved {d!r} to {args.output}")


if __name__ == "__main__":
    main()
