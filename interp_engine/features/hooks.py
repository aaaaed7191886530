"""The address a dictionary's own hook name means.

SAELens and Gemma Scope name where a dictionary reads with a TransformerLens hook name
(``blocks.10.hook_resid_post``). This is the one function that turns such a name into our
address. It is kept small and alone on purpose: when the library's TransformerLens-name table
(issue 26, ``interp_engine.tl_names``) is on main, :func:`hook_address` points at it.
"""

from __future__ import annotations

import re

from ..address import Address, to_address
from ..errors import AddressError

#: TransformerLens hook (after ``blocks.L.``) -> our site, where the tensor is exactly ours
_SITES = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
    "attn.hook_z": "z",
    "attn.hook_v": "v",
    "attn.hook_rot_q": "q",
    "attn.hook_rot_k": "k",
    "mlp.hook_post": "mlp_post",
}
#: hooks with no exact equivalent here -> what to do instead ({L}: the layer)
_CLOSEST = {
    "ln2.hook_normalized": "the MLP's normalised input is not a point here; the norm reads resid_mid.{L}",
    "hook_mlp_in": "the MLP reads resid_mid.{L} (through its norm)",
    "ln1.hook_normalized": "attention's normalised input is not a point here; the norm reads resid_pre.{L}",
    "attn.hook_q": "q.{L} is the queries after rotary (TransformerLens's attn.hook_rot_q)",
    "attn.hook_k": "k.{L} is the keys after rotary (TransformerLens's attn.hook_rot_k)",
    "mlp.hook_pre": "mlp_post.{L} is the hidden activation entering the down projection",
}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def is_hook_name(text: str) -> bool:
    """Whether ``text`` is a TransformerLens hook name rather than one of our addresses."""
    return isinstance(text, str) and text.startswith(("blocks.", "hook_"))


def hook_address(name: str) -> Address:
    """``"blocks.10.hook_resid_post"`` -> ``Address("resid_post", 10)``; our own address forms
    pass through. A hook with no exact equivalent is an :class:`AddressError` saying what to pass
    instead (``reads=``/``writes=`` on :func:`load_dictionary` overrides a file's hook name)."""
    if not is_hook_name(name):
        return to_address(name)
    match = _BLOCK.match(name.strip())
    if match and match.group(2) in _SITES:
        return Address(_SITES[match.group(2)], int(match.group(1)))
    if match and match.group(2) in _CLOSEST:
        why = _CLOSEST[match.group(2)].format(L=match.group(1))
        raise AddressError(f"hook {name!r} has no exact address here: {why}. Pass the address the dictionary "
                           f"should read, e.g. load_dictionary(path, reads=...) (only where it was trained "
                           f"on that tensor)")
    known = ", ".join(f"blocks.L.{h}" for h in _SITES)
    raise AddressError(f"hook {name!r} is not a TransformerLens name this engine maps to an address; known: "
                       f"{known}. Pass reads='resid_post.L' (or another address) to load_dictionary instead")


def hook_name(address: Address) -> str:
    """Our address as the TransformerLens hook name a SAELens config writes
    (``resid_post.10`` -> ``blocks.10.hook_resid_post``)."""
    for suffix, site in _SITES.items():
        if site == address.name and address.stream is None:
            return f"blocks.{address.layer}.{suffix}"
    raise AddressError(f"{address} has no TransformerLens hook name; these sites do: {', '.join(_SITES.values())}")
