"""KV-cache compression: the cache contract the model sees (contract), slot storage (storage) and the slot cache
built on it (slots), decode policies (policies), prompt compressors (prompt), capacities and layer schedules
(budgets). The public entry point is cache.py."""
