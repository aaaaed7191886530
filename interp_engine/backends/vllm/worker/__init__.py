"""Code that runs inside each vLLM worker process, mixed into vLLM's worker class.

``extension.py`` holds the methods the driver calls by name (``collective_rpc``); ``hooks.py``
records each request's rows, ``batch.py`` maps the flat batch to requests, ``rows.py`` stores what
was recorded, ``edits.py`` applies each request's edits to its own rows, ``kv_guard.py`` keeps
requests' KV blocks apart and ``experts.py`` reads the router's choice. Nothing here is imported by the
calling process except to check that it imports.
"""
