"""bench.py's benches, one module each (engine, policies, kv_bits, quantize, prefill, tiers, speculate, batch,
ragged, tp, compile), and what they share (common). Each module's BENCH (common.Bench) says how bench.py runs it
and which flags it takes."""
