"""Models already in memory and the small loading fixes (issue 26, items 7 and 11):
``load_model(hf_model, tokenizer=...)`` wraps a transformers model as it is (eager; vLLM and
cluster replicas load from a folder, and say so before starting anything), a path that does not
exist says so, ``device="cuda"`` without CUDA and ``cache.to(dtype)`` get the library's answers."""

from __future__ import annotations

import pytest
import torch

from interp_engine import InputError, ModelNotFound, load_model, run_with_cache


@pytest.fixture(scope="module")
def hf_and_tokenizer(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_path("llama")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), path


def test_a_model_in_memory_captures_what_its_folder_captures(hf_and_tokenizer, eager_models):
    hf, tokenizer, path = hf_and_tokenizer
    model = load_model(hf, tokenizer=tokenizer)
    assert model.hf is hf and model.backend == "eager" and model.tokenizer is tokenizer
    from_folder = eager_models("llama")
    tokens = from_folder.to_tokens(["held in memory", "two prompts"])
    got = run_with_cache(model, tokens, ["resid_post.1", "z.0", "logits"])
    want = run_with_cache(from_folder, tokens, ["resid_post.1", "z.0", "logits"])
    for address in want:
        assert torch.equal(got[address], want[address]), address  # same weights, same computation
    assert repr(model).startswith("EagerModel(") and "3 layers, float32, cpu" in repr(model)
    found = load_model(hf)  # its config names the folder it came from: the tokenizer saved there
    assert found.tokenizer("a b")["input_ids"] == tokenizer("a b")["input_ids"]


def test_a_model_in_memory_on_another_backend_or_without_a_tokenizer_is_refused(hf_and_tokenizer):
    from transformers import AutoModelForCausalLM

    hf, tokenizer, path = hf_and_tokenizer
    with pytest.raises(InputError, match=r"the vllm backend loads its weights itself from a folder.*"
                                         r"hf_model.save_pretrained\(folder\)"):
        load_model(hf, "vllm", tokenizer=tokenizer)
    with pytest.raises(InputError, match="cannot be sent to cluster replicas"):
        load_model(hf, tokenizer=tokenizer, replicas=2)
    with pytest.raises(InputError, match=r"move it first \(hf_model.to\('cpu'\)\)"):
        load_model(hf, tokenizer=tokenizer, device="cpu")
    fresh = AutoModelForCausalLM.from_config(hf.config)
    fresh.config.name_or_path = ""
    with pytest.raises(InputError, match=r"needs its tokenizer: load_model\(hf_model, tokenizer=tokenizer\)"):
        load_model(fresh)
    with pytest.raises(InputError, match="takes a name, a folder or a transformers causal LM.*got a Linear"):
        load_model(torch.nn.Linear(2, 2), tokenizer=tokenizer)


def test_a_path_that_does_not_exist_says_so(tmp_path):
    for missing in ["/path/that/does/not/exist", str(tmp_path / "nope" / "model"), "./not/here/either"]:
        with pytest.raises(ModelNotFound, match=r"no such folder") as info:
            load_model(missing)
        assert "huggingface-cli" not in str(info.value)
    with pytest.raises(ModelNotFound, match=rf"nearest folder that exists is {tmp_path}"):
        load_model(str(tmp_path / "nope" / "model"))
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):  # a hub id still reads as one
        load_model("some-org/not-cached-model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_is_a_library_message(tiny_path, eager_models):
    with pytest.raises(InputError, match=r"device='cuda', but torch sees no CUDA device here.*use device='cpu'"):
        load_model(str(tiny_path("llama")), device="cuda")
    model = eager_models("llama")
    cache = run_with_cache(model, model.to_tokens("x"), ["resid_post.0"])
    with pytest.raises(InputError, match="torch sees no CUDA device"):
        cache.to("cuda")


def test_cache_to_takes_a_dtype_or_a_device(eager_models):
    model = eager_models("llama")
    cache = run_with_cache(model, model.to_tokens(["a dtype", "or a device"]), ["resid_post.0", "z.1"])
    half = cache.to(torch.float16)
    for address, tensor in cache.items():
        assert half[address].dtype == torch.float16 and torch.equal(half[address], tensor.half())
    assert torch.equal(half.tokens, cache.tokens) and half.n_layers == cache.n_layers
    assert cache.to("cpu", torch.bfloat16)["z.1"].dtype == torch.bfloat16
    with pytest.raises(TypeError, match="neither a device .* nor a torch.dtype"):
        cache.to("float16")
