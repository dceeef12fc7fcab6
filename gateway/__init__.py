"""The HTTP gateway: job API v1 over Redis. Entry points: `gateway.app.create_app(config)` (the
aiohttp application) and `gateway.main.run_gateway(config)` (serve it until SIGTERM/SIGINT).

Modules, one job each:
  app.py          the application factory; Redis client and tokenizer threads live in its cleanup_ctx
  state.py        typed AppKeys / RequestKeys
  routes.py       every route
  middleware.py   request ids (+ one log line per request); every error → JSON
  errors.py       error code → HTTP status, the JSON error body, RequestError (an error naming a field)
  auth.py         Bearer API key → tenant
  json_body.py    strict JSON decoding of request bodies
  job_request.py  POST /v1/jobs body → JobRequest, field by field
  tokenization.py per-model tokenizers from the model registry, encoding off the event loop
  job_service.py  submit / get / wait / cancel, free of HTTP
  views/          handlers: parse, call the service, render

HTTP contract decisions:
  202  POST /v1/jobs queued a new job; 200 when an Idempotency-Key repeats (same id, current status;
       the key is per tenant and lives as long as the job record; the repeated body is not compared).
  200  POST /v1/jobs/{id}/cancel always answers with the job's state after the call: a job that had
       already finished keeps its terminal status, so cancelling is safe to retry.
  400  invalid_json (not UTF-8 JSON, NaN/Infinity literals, duplicate keys, nesting too deep),
       invalid_request (wrong type or value, unknown field; `param` names it), empty_prompt,
       invalid_token_id, context_length_exceeded, adapter_model_mismatch.
  401  missing_api_key, invalid_api_key (with WWW-Authenticate: Bearer); 403 tenant_disabled.
  404  job_not_found, model_not_found, adapter_not_found: another tenant's job or adapter gets exactly
       the answer a missing one gets; not_found for unknown routes. 405 method_not_allowed (+ Allow).
  413  payload_too_large: a body over limits.max_body_bytes, or a text prompt over
       limits.max_prompt_chars (then with param "prompt").
  500  internal_error: the message carries the request id; the exception is logged, never sent.
  A JSON null for an optional field means its default. Text prompts are encoded with the model's
  special tokens (e.g. BOS); token-id prompts are queued exactly as given.
"""
