"""Multi-LoRA serving: PEFT adapters read and checked (adapter.py), held in host memory and swapped
into the graph's stacked device slots (manager.py). The graph side is graphs/lora.py."""
