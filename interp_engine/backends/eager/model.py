"""The eager backend: Hugging Face transformers with forward hooks.

It serves every site, padded batches and gradients. A capture hooks only the requested
modules, keeps the tensors the model itself computed (no recomputation), and stops the forward
after the last requested layer when the logits are not asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import torch

from interp_engine import cancel
from interp_engine.address import SITES, Address
from interp_engine.archs import arch_for, describe, model_info, record_for_model, unserved_sites
from interp_engine.cache import Cache
from interp_engine.capabilities import Capabilities
from interp_engine.dtypes import dtype_name
from interp_engine.errors import InputError
from interp_engine.features.run import FeatureRun, Placed
from interp_engine.generation import Step, step_scores
from interp_engine.model import CaptureModel, Completion
from interp_engine.positions import held_positions
from interp_engine.request import Request
from interp_engine.tokens import Tokenizer, fed_tokens
from . import attention
from .recorder import Recorder, StopForward
from .sampling import sample_next


def zero_padding(tensor: torch.Tensor, mask: torch.Tensor, address: Address) -> torch.Tensor:
    """Zero every padded position (query rows of a pattern), so padding never reads as data."""
    axis = address.query_axis
    keep = mask.reshape(mask.shape[0], *(mask.shape[1] if d == axis else 1 for d in range(1, tensor.dim())))
    return torch.where(keep.to(tensor.device), tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


class EagerModel(CaptureModel):
    capabilities = Capabilities(
        "eager", "HF transformers", batched=True, forms_pattern=True, gradients=True,
        writable=frozenset({"resid_pre", "attn_out", "attn_out_post", "resid_mid", "mlp_out", "mlp_out_post", "resid_post",
                            "z", "mlp_post", "q", "k",
                            "v", "pattern", "resid_streams"}),
        function_edits=True, takes_device=True, features=True)

    @classmethod
    def capabilities_for(cls, hf_config) -> Capabilities:
        """The capabilities of a model with this config: every site its family table maps."""
        return cls.capabilities.serving(unserved_sites(arch_for(hf_config).sites))

    @classmethod
    def load(cls, path, name: str, *, dtype: torch.dtype, device: str | None = None, requires_grad: bool = False,
             **options) -> "EagerModel":
        """Load the Hugging Face folder ``path`` in this process (``device``: where the weights go)."""
        if options:
            raise TypeError(f"options {sorted(options)} are not eager-backend options")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if device:
            hf = hf.to(device)
        return cls(hf, AutoTokenizer.from_pretrained(path), name, requires_grad=requires_grad)

    @classmethod
    def from_module(cls, hf_model, hf_tokenizer, name: str, *, requires_grad: bool = False) -> "EagerModel":
        """Wrap a transformers model already in memory, as it is (``model.hf`` is ``hf_model``)."""
        return cls(hf_model, hf_tokenizer, name, requires_grad=requires_grad)

    def __init__(self, hf_model, hf_tokenizer, name: str, *, requires_grad: bool = False):
        self.hf = hf_model.eval()
        self.dtype = dtype_name(hf_model.dtype)
        self.arch = record_for_model(hf_model)
        self.info = model_info(hf_model.config, name, self.arch)
        self.capabilities = self.capabilities.serving(unserved_sites(self.arch.sites))
        logging.getLogger("interp_engine").info("%s: %s", name, describe(self.arch, hf_model.config.model_type))
        self.tok = Tokenizer(hf_tokenizer)
        self.requires_grad = requires_grad
        self.hf.requires_grad_(requires_grad)
        self._lock = threading.Lock()
        self._dictionaries = Placed()
        # SDPA drops attention softcapping (Gemma 2's attn_logit_softcapping): such a model always
        # runs its family's eager attention, which applies it
        softcapped = getattr(hf_model.config, "attn_logit_softcapping", None) is not None
        wrapped = attention.EAGER if softcapped or attention.implementation(self.hf) == "eager" else attention.SDPA
        attention.set_implementation(self.hf, wrapped)

    def drop_dictionary(self, key: str) -> None:
        """Forget this model's device copy of the dictionary with content key ``key``."""
        self._dictionaries.drop(key)

    def _repr_extras(self) -> list[str]:
        return [str(self.device)] + (["requires_grad"] if self.requires_grad else [])

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def o_proj_weight(self, layer: int) -> torch.Tensor:
        layer_module = self.hf.get_submodule(self.arch.layers)[layer]
        return self.arch.linear_weight(layer_module.get_submodule(self.arch.o_proj).weight)

    def final_norm(self, resid: torch.Tensor) -> torch.Tensor:
        """The norm the model applies to the last ``resid_post`` before unembedding, ``[..., d_model]``."""
        norm = self.hf.get_submodule(self.arch.final_norm)
        return norm(resid.to(self.device))

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        """``[..., d_model]`` -> ``[..., vocab]`` logits: the unembedding, then the final logit
        softcapping where the config has one (Gemma 2). ``unembed(final_norm(resid_post.L))``
        for the last layer is the model's own logits."""
        logits = self.hf.get_submodule(self.arch.unembed)(normed.to(self.device))
        cap = self.arch.softcap(self.hf.config)
        return torch.tanh(logits / cap) * cap if cap else logits

    def unembed_weight(self) -> torch.Tensor:
        """``W_U``, ``[d_vocab, d_model]``: the row of a token is its unembedding direction (the
        unembedding is an ``nn.Linear`` in every family, whatever its layers' projections are)."""
        return self.hf.get_submodule(self.arch.unembed).weight

    def unembed_weights(self):
        """The final norm's and the unembedding's weights as plain tensors (what a replica sends)."""
        from interp_engine.unembedding import UnembedWeights

        norm = self.hf.get_submodule(self.arch.final_norm)
        return UnembedWeights(self.hf.config.to_dict(), self.arch.final_norm,
                              {k: v.detach().cpu() for k, v in norm.state_dict().items()},
                              self.unembed_weight().detach().cpu())

    def _grad_context(self, detach: bool):
        if detach:
            return torch.no_grad()
        if not self.requires_grad:
            raise InputError(
                "detach=False needs a model loaded for gradients: "
                "load_model(name, backend='eager', requires_grad=True)"
            )
        return contextlib.nullcontext()

    def _recorder(self, addresses, *, detach, stop_early, positions=None, edits=None, features=None):
        """The hooks of one call; a call with dictionaries (``features``, a FeaturePlan) runs each
        inside the hook of its site, and its feature points are recorded beside the addresses."""
        if features is None:
            return Recorder(self.hf, self.arch, self.info, addresses, detach=detach, stop_early=stop_early,
                            positions=positions, edits=edits)
        run = FeatureRun(features, self.device, place=self._dictionaries)
        recorder = Recorder(self.hf, self.arch, self.info, [*addresses, *features.points], detach=detach,
                            stop_early=stop_early, positions=positions, edits=run.edits(edits))
        run.sink = recorder.keep
        return recorder

    def _execute(self, request: Request):
        if request.options is not None:
            return self._generate(request)
        tokens, addresses, detach = request.tokens, list(request.points), request.detach
        positions, edits = request.positions, request.edits
        mask = tokens >= 0
        want_logits = any(getattr(SITES.get(a.name), "unembedding", False) for a in addresses)
        whole = any(a.layer is None for a in addresses)  # the logits or the final norm: every layer runs
        with self._lock, self._grad_context(detach):
            cancel.checkpoint("before it ran")  # a cancelled call queued on the lock never runs
            with self._recorder(addresses, detach=detach, stop_early=not whole,
                                positions=positions, edits=edits, features=request.features) as recorder:
                try:
                    out = self.hf(
                        input_ids=tokens.clamp(min=0).to(self.device),
                        attention_mask=mask.to(self.device),
                        use_cache=False,
                        logits_to_keep=0 if want_logits else 1,
                    )
                    recorder.keep(Address("logits"), out.logits)
                except StopForward:
                    pass
        recorded = recorder.result()
        if positions is not None:  # the selection already left padding out (and zeroed its fill)
            held = held_positions(positions, mask.sum(dim=1).tolist())
            return Cache(recorded, tokens, None, self.name, self.backend, held)
        if not mask.all():
            recorded = {a: zero_padding(t, mask, a) for a, t in recorded.items()}
        return Cache(recorded, tokens, mask, self.name, self.backend)

    async def _stream(self, request: Request):
        """Each step of ``_generate`` as it is made: the decode loop runs in a thread and hands
        its steps over a queue; closing the iterator (a ``break``, a cancelled task) ends the loop
        at the next step."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop, done = threading.Event(), object()

        def on_step(step) -> bool:
            loop.call_soon_threadsafe(queue.put_nowait, step)
            return not stop.is_set()

        def run():
            try:
                self._generate(request, on_step)
                loop.call_soon_threadsafe(queue.put_nowait, done)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
                loop.call_soon_threadsafe(queue.put_nowait, err)

        threading.Thread(target=run, name="interp-engine-stream", daemon=True).start()
        try:
            while (item := await queue.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()

    def _generate(self, request: Request, on_step=None):
        """``(completion, cache)`` of a generation; ``on_step(Step)`` (if given) is told each
        token as it is chosen, with the captures of the forward that chose it, and ends the
        generation by returning False."""
        from transformers import DynamicCache

        tokens, addresses, options = request.tokens, list(request.points), request.options
        positions, edits = request.positions, request.edits
        generator = torch.Generator().manual_seed(options.seed) if options.seed is not None else None
        generated: list[int] = []
        logprobs: list[float] = []
        tops: list = []
        finish = "length"
        past = DynamicCache(config=self.hf.config)
        step_ids = tokens.to(self.device)
        with self._lock, torch.no_grad():
            with self._recorder(addresses, detach=True, stop_early=False, positions=positions,
                                edits=edits, features=request.features) as recorder:
                for step in range(options.max_tokens):
                    cancel.checkpoint(f"after {step} of {options.max_tokens} decode steps")
                    start = recorder.start = past.get_seq_length()
                    position = torch.arange(start, start + step_ids.shape[1], device=self.device)
                    out = self.hf(input_ids=step_ids, position_ids=position[None], past_key_values=past,
                                  use_cache=True)
                    past = out.past_key_values
                    recorder.keep(Address("logits"), out.logits)
                    next_id = sample_next(out.logits[0, -1], options, generator)
                    logprob, top = step_scores(out.logits[0, -1], next_id, options.top_logprobs)
                    logprobs.append(logprob)
                    tops.append(top)
                    generated.append(next_id)
                    if on_step is not None and not on_step(Step(
                            step, next_id, self.tok.decode([next_id]), logprob, top,
                            {a: recorder.chunks[a][-1] for a in recorder.addresses if len(recorder.chunks[a]) > step})):
                        finish = "abort"
                        break
                    if options.stop_at_eos and next_id == self.tok.eos_token_id:
                        finish = "stop"
                        break
                    step_ids = torch.tensor([[next_id]], device=self.device)
        fed = fed_tokens(tokens, generated)
        completion = Completion(self.tok.decode(generated), generated, finish, logprobs,
                                tops if options.top_logprobs else None)
        held = None if positions is None else held_positions(positions, [tokens.shape[1]], [fed.shape[1]])
        return completion, Cache(recorder.result(), fed, None, self.name, self.backend, held)

    def close(self):
        pass


