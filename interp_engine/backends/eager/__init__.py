"""The eager backend: a Hugging Face model in this process, read and edited with forward hooks.

``model.py`` is the backend (:class:`~.model.EagerModel`); ``recorder.py`` places the hooks;
``attention.py`` / ``attention_edits.py`` reach inside attention (q, k, v, the pattern);
``sampling.py`` picks the next token of its generation loop.
"""
