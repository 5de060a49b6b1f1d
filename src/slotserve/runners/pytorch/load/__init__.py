"""What the runner reads before its first step: its settings, the checkpoint (an HF folder or a
GGUF file: configuration, tokenizer, weights), how projections' weights are stored (the weight
format), PEFT adapters, and the memory a load takes."""
