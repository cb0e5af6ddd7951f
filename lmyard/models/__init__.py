"""Model families as specs (GPT-2, Llama), the registry that maps model.arch to a spec, and losses."""
