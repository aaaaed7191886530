"""Features: sparse dictionaries (SAEs, transcoders) run where the activations are made.

A :class:`Dictionary` is loaded from local files (:func:`load_dictionary`: SAELens folders,
Gemma Scope ``params.npz``, plain tensors) and attached to a capture with ``saes=``; its
features are then points of the same address space (``"resid_post.3.features"``), encoded in
the hook that produces the activation, and editable there (see ``docs/FEATURES.md``).
"""

from .dictionary import Dictionary as Dictionary
from .load import load_dictionary as load_dictionary
from .load import save_dictionary as save_dictionary
from .splice import SpliceLoss as SpliceLoss
from .splice import ce_loss_recovered as ce_loss_recovered
from .splice import splice_edits as splice_edits
