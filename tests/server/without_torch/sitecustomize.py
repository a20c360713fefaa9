"""Put on PYTHONPATH by `server_env`: the radix-mlx processes the tests start (servers,
their engine processes, replicas' workers) run without torch, as an install of radix-mlx
does. torch is here only for the test process (sentence-transformers, the references the
embeddings and rerank tests compare with), and transformers, which every server and engine
process imports for its tokenizer, imports all of torch once it finds it installed: ~1.5 s
of CPU per process on 2 cores, twice per server start.

A None in sys.modules is how Python marks a module as absent: importing it raises
ImportError and `importlib.util.find_spec` (transformers' check) answers None."""

import sys

sys.modules.setdefault("torch", None)
