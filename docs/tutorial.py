# %% [markdown]
# # Where does SmolLM2 find "Paris"? A TransformerLens-style walk through interp_engine
#
# A notebook as a script: run it whole (`python docs/tutorial.py`, about a minute on a laptop
# CPU), or cell by cell (`# %%`) in VS Code / Jupyter. It uses the embedded SmolLM2-135M
# (`load_model()`, offline) and the everyday tools: string tokens, whole-site captures at one
# position, the logit lens, the residual stream decomposed into what wrote it, and logit
# attribution to layers and to attention heads, and an activation-patching sweep over every layer
# and position in one batched call per layer. TransformerLens's hook names work as addresses
# (`"blocks.29.hook_resid_post"` is `resid_post.29`), as do negative layers (`-1`: the last).
# Every claim it prints is also asserted, so the test suite runs this file
# (tests/test_tutorial.py). The same calls work on a cluster model (`replicas=N`, eager or vLLM
# replicas) and on `load_model(backend="vllm")`, which takes one prompt per call: there the
# sweep's batched call becomes one call per row, each with its own row's value.

# %%
import torch

from interp_engine import (Add, Set, accumulated_resid, decompose_resid, head_contributions, lens_top, load_model,
                           logit_attribution, logit_lens, run_with_cache, stack)

torch.set_grad_enabled(False)
model = load_model()  # eager; backend="vllm" or replicas=2 give the same answers
prompt = "The capital of France is"
tokens = model.to_tokens(prompt)  # SmolLM2's tokenizer adds no BOS; prepend_bos=True would
print(model.to_str_tokens(tokens))

# %% [markdown]
# ## One capture: whole sites, last position only
#
# A site name alone is every layer (`"resid_post"` is 30 addresses, in layer order). We only
# need the last position (where the model predicts the next token), so `positions=-1`: the other
# positions are never copied out of the forward pass.

# %%
points = ["blocks.0.hook_resid_pre", "resid_post", "attn_out_post", "mlp_out_post", "z", "logits"]  # TL names or ours
cache = run_with_cache(model, tokens, points, positions=-1)
print(cache)
assert len(model.points("resid_post")) == model.cfg.n_layers == 30
assert cache["blocks.29.hook_resid_post"] is cache["resid_post", -1] is cache["resid_post.29"]
assert cache["resid_post", -1].shape == (1, 1, model.cfg.d_model)

answer_id = int(cache["logits"][0, -1].argmax())
answer = model.to_string([answer_id])
print("the model's next token:", repr(answer))
assert answer == " Paris"

# %% [markdown]
# ## The logit lens
#
# Each layer's residual stream through the final norm and the unembedding: what the model would
# say if it stopped there. The answer appears late.

# %%
top = lens_top(model, cache)
lens = logit_lens(model, cache)  # [layers, batch, pos, vocab]
p_answer = lens[:, 0, -1].softmax(-1)[:, answer_id]
first = next(L for L in top.layers if int(top.ids[L, 0, -1]) == answer_id)
for L in top.layers[-6:]:
    print(f"layer {L:2d}: top {model.to_string([int(top.ids[L, 0, -1])])!r:12} p(answer) = {float(p_answer[L]):.3f}")
print(f"' Paris' is the lens's top token from layer {first} on")
assert torch.allclose(lens[-1], cache["logits"], rtol=1e-4, atol=1e-4)  # exact at the last layer

# %% [markdown]
# The accumulated residual stream (`resid_pre.L` at entry L) through the final norm is the
# lens's input: the same numbers.

# %%
acc = accumulated_resid(cache, apply_ln=True, model=model)  # [31, batch, pos, d_model]
assert torch.allclose(model.unembed(acc[1:]), lens, rtol=1e-4, atol=1e-3)
assert torch.equal(stack(cache, "resid_post")[4], cache["resid_post.4"])

# %% [markdown]
# ## Decomposing the residual stream
#
# The final residual stream is the embedding plus what every attention block and every MLP
# wrote. Logit attribution puts each piece through the final norm (frozen at the final residual,
# so the pieces still add up) and onto the unembedding direction of a token. The logit
# *difference* between the answer and a plausible alternative says which pieces choose "Paris".

# %%
parts, labels = decompose_resid(cache, return_labels=True)  # [61, batch, pos, d_model]
assert torch.allclose(parts.sum(0), cache["resid_post.29"], rtol=1e-4, atol=1e-2)
alternative = model.to_tokens(" Lyon", prepend_bos=False)[0, 0]
attribution = logit_attribution(model, cache, answer_id) - logit_attribution(model, cache, int(alternative))
diff = attribution[:, 0, -1]
logits = cache["logits"][0, -1]
assert torch.allclose(diff.sum(), logits[answer_id] - logits[alternative], rtol=1e-3, atol=1e-3)
order = diff.argsort(descending=True)
print("logit difference ' Paris' - ' Lyon':", f"{float(diff.sum()):.2f}")
print("written most by:", ", ".join(f"{labels[i]} ({float(diff[i]):+.2f})" for i in order[:5]))

# %% [markdown]
# ## Which heads?
#
# `head_contributions(model, cache, L)` is what each head of layer L writes into the residual
# stream (`z` through that head's slice of the output projection). Attributing those the same
# way ranks the heads; at each layer they sum to the attention block's share.

# %%
per_head = []
for L in range(model.n_layers):
    heads = head_contributions(model, cache, L).permute(2, 0, 1, 3)  # [heads, batch, pos, d_model]
    score = logit_attribution(model, cache, answer_id, components=heads)
    score -= logit_attribution(model, cache, int(alternative), components=heads)
    per_head.append(score[:, 0, -1])
    assert torch.allclose(score.sum(0)[0, -1], diff[labels.index(f"attn_out_post.{L}")], rtol=1e-3, atol=1e-3)
per_head = torch.stack(per_head)  # [layers, heads]
best = per_head.flatten().argsort(descending=True)[:3]
print("top heads:", ", ".join(f"L{int(i) // model.n_heads}H{int(i) % model.n_heads} ({float(per_head.flatten()[i]):+.2f})"
                              for i in best))

# %% [markdown]
# ## Activation patching: where does the model keep "France"?
#
# Run "The capital of France is" (it says " Paris") and patch in the residual stream of
# "The capital of Italy is" (" Rome") at one layer and one position: how much of the way to
# " Rome" does that one patch move the answer? A TransformerLens sweep is one forward per
# (layer, position). Here an edit's value may carry a batch axis, one value per row: a batch of
# `n` copies of the France prompt, row `i` patched at position `i` only (an `Add` of the
# difference, zero everywhere else), is the whole row of the grid for one layer in one call.

# %%
italy = model.to_tokens("The capital of Italy is")
n = tokens.shape[1]
assert italy.shape == tokens.shape  # the two prompts differ in one token, " France" / " Italy"
rome = int(model.to_tokens(" Rome", prepend_bos=False)[0, 0])
clean = run_with_cache(model, italy, ["resid_pre", "logits"])
corrupt = run_with_cache(model, tokens, ["resid_pre", "logits"])


def rome_minus_paris(logits):
    return logits[..., rome] - logits[..., answer_id]


clean_diff, corrupt_diff = rome_minus_paris(clean["logits"][0, -1]), rome_minus_paris(corrupt["logits"][0, -1])
recovered = torch.zeros(model.cfg.n_layers, n)  # fraction of the way from ' Paris' to ' Rome'
for L in range(model.cfg.n_layers):
    delta = torch.zeros(n, n, model.cfg.d_model)  # [batch = positions, pos, d_model]
    for i in range(n):
        delta[i, i] = clean["resid_pre", L][0, i] - corrupt["resid_pre", L][0, i]
    patched = run_with_cache(model, tokens.repeat(n, 1), ["logits"], positions=-1,
                             edits={f"blocks.{L}.hook_resid_pre": Add(delta)})
    recovered[L] = (rome_minus_paris(patched["logits"][:, 0]) - corrupt_diff) / (clean_diff - corrupt_diff)

names = model.to_str_tokens(tokens)
moved = next(L for L in range(model.cfg.n_layers) if recovered[L, -1] > 0.5)
for L in [0, moved - 1, moved, model.cfg.n_layers - 1]:
    print(f"resid_pre.{L:2d}: " + "  ".join(f"{names[i]!r} {float(recovered[L, i]):+.2f}" for i in range(n)))
print(f"the answer moves from {names[3]!r} to {names[-1]!r} at layer {moved}")
assert recovered[0, 3] > 0.99 and recovered[-1, -1] > 0.99  # the country token early, the last token late
assert recovered[:, :3].abs().max() < 1e-3  # the tokens both prompts share: nothing to patch
assert recovered[-1, 3] < 0.05 and recovered[0, -1] < 0.05

# One cell of the grid, patched alone the ordinary way: the same number (a batch of one row
# instead of n is a different computation, so within float rounding).
one = run_with_cache(model, tokens, ["logits"], positions=-1,
                     edits={f"resid_pre.{moved}": Set(clean["resid_pre", moved][0, -1], positions=[-1])})
alone = (rome_minus_paris(one["logits"][0, 0]) - corrupt_diff) / (clean_diff - corrupt_diff)
assert abs(float(alone) - float(recovered[moved, -1])) < 1e-3
