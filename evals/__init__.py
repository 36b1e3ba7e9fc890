"""eval.py's parts: tasks (prompts, texts, scoring), caches (the Evaluator's prefill replay and cache wrappers),
evaluator (the grid of cells and running it), text (perplexity and attention loss), store (results.json),
report (summary.md and plots), ray (the cells as Ray tasks)."""
