"""activation_stream through a service connection (Ray and HTTP): an epoch is a dataset build's rows."""

from __future__ import annotations

from interp_engine import activation_stream, connect

from ...oracles import torch_threads
from ...stream.rows import as_rows, built_rows, joined, same_multiset
from .served import NAME

PROMPTS = [f"Row {i}: " + "one two three " * (1 + i % 3) for i in range(12)]


def test_stream_through_a_connection_is_the_dataset(service, eager_models, tmp_path):
    with torch_threads(1):
        want = as_rows(built_rows(eager_models("llama"), PROMPTS, ["resid_post.1"], tmp_path / "d", shard_size=2),
                       ["resid_post.1"])
    for model in (connect(NAME), connect(service.url, token=service.token)):
        stream = activation_stream(model, PROMPTS, ["resid_post.1"], batch_tokens=32, shuffle_buffer=64,
                                   shard_size=2, progress=False)
        assert stream.prefetch == 4
        assert same_multiset(joined(stream, ["resid_post.1"]), want)
