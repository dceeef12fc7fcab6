"""The network: the decoder-only LM over a flat token batch with a paged KV cache and paged LoRA slots.

Imports kernels/ and shared/ only: nothing of the engine, the adapter pool or switching."""
