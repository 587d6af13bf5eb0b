"""LoRA adapters: PEFT folders loaded onto the linear layers, many applied in one batch."""
