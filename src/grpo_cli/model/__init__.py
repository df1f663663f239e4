"""The model: loading a base (hub, the embedded GGUF, the tiny test model) with its LoRA adapter (loading),
model.dtype and the device (precision), the CPU's prepacked frozen layers (prepack), the C allocator the commands
run on (allocator), and whether a trained adapter fits a base (adapter_fit).

May import: config, base."""
