"""The address a dictionary's own hook name means.

SAELens and Gemma Scope name where a dictionary reads with a TransformerLens hook name
(``blocks.10.hook_resid_post``). The library's one table of those names is
:mod:`interp_engine.tl_names` (what :func:`~interp_engine.parse_address` reads them with); this
module only says, where a file's hook has no exact equivalent, how to load the dictionary anyway.
"""

from __future__ import annotations

from ..address import Address, parse_address, to_address
from ..errors import AddressError
from ..tl_names import is_tl_name, tl_name


def is_hook_name(text: str) -> bool:
    """Whether ``text`` is a TransformerLens hook name rather than one of our addresses."""
    return isinstance(text, str) and is_tl_name(text.strip())


def hook_address(name: str) -> Address:
    """``"blocks.10.hook_resid_post"`` -> ``Address("resid_post", 10)``; our own address forms
    pass through. A hook with no exact equivalent is an :class:`AddressError` naming the closest
    address and what to pass instead (``reads=``/``writes=`` on :func:`load_dictionary` overrides
    a file's hook name)."""
    if not is_hook_name(name):
        return to_address(name)
    try:
        return parse_address(name)
    except AddressError as err:
        raise AddressError(f"hook {name!r}: {err}. Pass the address the dictionary should read, e.g. "
                           f"load_dictionary(path, reads=...) (only where it was trained on that tensor)") from None


def hook_name(address: Address) -> str:
    """Our address as the TransformerLens hook name a SAELens config writes
    (``resid_post.10`` -> ``blocks.10.hook_resid_post``)."""
    return tl_name(address)
