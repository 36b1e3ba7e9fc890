"""KV-cache compression: slot buffers (slots), decode policies (policies), prompt compressors (prompt),
capacities and layer schedules (budgets). The public entry point is cache.py."""
