"""Building fastcoll's C++/CUDA extension against the running torch, and caching the result.

A wheel built in isolation (``pip install .``) carries the extension's sources
(``fastcoll/_csrc``) and compiles nothing; ``import fastcoll`` compiles them
once against the torch it runs with (ninja, ``MAX_JOBS`` parallel jobs) into
``$FASTCOLL_CACHE_DIR`` (default ``~/.cache/fastcoll``), and later imports load
that build. ``python -m fastcoll.extension`` does the compile ahead of time.

Modules, one concern each: spec (sources and flags, shared with setup.py),
toolchain (compiler, nvcc, ninja, jobs), key (what a build is for, its cache
key), cache (the cache's layout), lock (one build per key at a time),
compile (one build, in a child process), jit (all of it, for an import).
"""
