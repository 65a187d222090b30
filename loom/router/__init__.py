"""`loom router`: an OpenAI-compatible proxy in front of independent `loom serve` replicas.

Each request goes to the replica most likely to hold its prompt's prefix in its KV cache
(policy.py), unless that replica is much busier than the least busy one; replicas are
health-checked and a request whose replica failed before anything was streamed is retried on
another (backends.py, app.py). `loom serve --data-parallel-size N` starts N replicas and this
router in one command (loom/entrypoints/openai/data_parallel.py).
"""
