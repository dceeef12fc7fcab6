"""The engine: requests in, device steps out. Sequences and the scheduler (who runs), the block
manager (KV pages), the model runner (the device: eager steps and decode graphs), the sampler, the
detokenizer and the admission pacer; engine.py ties them to the adapter pool."""
