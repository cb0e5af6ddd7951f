"""Model families as specs (GPT-2, Llama), the registry that maps model.arch to a spec, losses, memory planning and FSDP2."""
