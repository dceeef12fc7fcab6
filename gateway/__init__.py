"""The HTTP gateway: job API v1, OpenAI-compatible endpoints and the admin API over Redis. Entry
points: `gateway.app.create_app(config)` (the aiohttp application) and `gateway.main.run_gateway(config)`
(serve it until SIGTERM/SIGINT).

Modules, one job each:
  app.py          the application factory; Redis client and tokenizer threads live in its cleanup_ctx
  state.py        typed AppKeys / RequestKeys
  routes.py       every route
  middleware.py   one middleware: request ids, every error → JSON, request metrics, one log line per request
  metrics.py      the Prometheus registry of one app (requests, latency, queue depth)
  errors.py       error code → HTTP status, the JSON error body, RequestError (an error naming a field)
  json_response.py  JSON responses (orjson)
  auth.py         Bearer API key → tenant (the Authenticator remembers it for a few seconds)
  auto_pipeline.py  one Redis pipeline for the commands of one event-loop turn (turn_batch.py)
  json_body.py    strict JSON decoding of request bodies
  job_request.py  POST /v1/jobs body → JobRequest, field by field
  openai_request.py  /v1/completions and /v1/chat/completions bodies → prompt/messages + sampling
  chat.py         chat messages → prompt with the model's Jinja chat template (sandboxed)
  sse.py          server-sent event streams
  admin.py        admin-key check; adapter registration for the admin and load_lora_adapter routes
  webhook_policy.py     which webhook URLs a job may name (allow-list, https)
  webhook_signature.py  HMAC signatures of webhook calls; each tenant's signing key
  webhooks.py     WebhookDispatcher: consumes lf:webhooks (one group across gateways), calls, retries
  tokenization.py per-model tokenizers from the model registry, encoding off the event loop
  job_service.py  submit (with admission limits) / get / wait / events / cancel, model-name resolution
  openai_completion.py  an OpenAI request as a job, a finished job as a completion (endpoints and batches)
  upload.py       a multipart upload read as a bounded stream; anything malformed is invalid_multipart
  batch_input.py  a batch input file checked at upload: UTF-8 JSONL, a unique custom_id per line
  files.py        FileStore: files in Redis (metadata hash + one list element per line), expiry
  batches.py      BatchStore: batch records, compare-and-set status changes, retention
  batch_lines.py  one input line → a batch-class job request; its output or error line
  batch_driver.py BatchDriver: every gateway leases active batches in turn and moves them along
  views/          handlers: parse, call the service, render

HTTP contract decisions:
  202  POST /v1/jobs queued a new job; 200 when an Idempotency-Key repeats (same id, current status;
       the key is per tenant and lives as long as the job record; the repeated body is not compared).
  200  POST /v1/jobs/{id}/cancel always answers with the job's state after the call: a job that had
       already finished keeps its terminal status, so cancelling is safe to retry.
  400  invalid_json (not UTF-8 JSON, NaN/Infinity literals, duplicate keys, nesting too deep),
       invalid_request (wrong type or value, unknown field; `param` names it), empty_prompt,
       invalid_token_id, context_length_exceeded, adapter_model_mismatch, webhook_not_allowed (a
       `webhook` URL off the allow-list or not https, or webhooks off on this gateway),
       adapter_exceeds_model_limits (an adapter, at registration or in a job, needing a LoRA rank or
       projections the model's live workers have no slots for, as they publish in its record).
  401  missing_api_key, invalid_api_key (with WWW-Authenticate: Bearer); 403 tenant_disabled.
  404  job_not_found, model_not_found, adapter_not_found: another tenant's job or adapter gets exactly
       the answer a missing one gets; not_found for unknown routes. 405 method_not_allowed (+ Allow).
  Adapter registration (load_lora_adapter, admin): a path outside the owner's directory of the
       adapter root is 403 adapter_path_forbidden whether or not it exists; a missing directory of
       its own 404 adapter_path_not_found; every other refusal a 400 naming the problem
       (shared/errors.py, the README's table). 400 tenant_name_reserved for an admin's `shared`.
  413  payload_too_large: a body over limits.max_body_bytes, or a text prompt over
       limits.max_prompt_chars (then with param "prompt"); file_too_large: an upload over
       batches.max_file_bytes.
  Files and batches: POST /v1/files and POST /v1/batches answer 200 with the object (as OpenAI's);
  an upload that is not batch JSONL is a 400 naming the problem (invalid_multipart, invalid_purpose,
  invalid_file_encoding, invalid_jsonl with the line, empty_file, file_too_many_lines); another
  tenant's file or batch is file_not_found / batch_not_found, like a missing one; cancelling a batch
  that is past cancelling answers with the batch as it is.
  429  rate_limit_exceeded (a tenant's requests/min, tokens/min or concurrent jobs) and queue_full (the
       model's queue cap), both with Retry-After. A job larger than a minute's tokens is a 400.
  403  forbidden / admin_disabled on /v1/admin/*: only the admin key (whose SHA-256 is configured) passes.
  500  internal_error: the message carries the request id; the exception is logged, never sent.
  OpenAI routes: `model` is BASE, BASE:ADAPTER or an adapter name; the completion's id is its job id.
  A chat on a model without a chat template is 400 chat_template_missing. A job that fails answers
  with its error code (500). Streams (SSE) end with `data: [DONE]`; their text deltas always add up
  to the job's final text (held-back text comes from the final record).
  Token events: a worker publishes them only for jobs queued with the `stream` flag, which the gateway
  sets for OpenAI `stream: true` and for POST /v1/jobs with `"stream": true`. GET /v1/jobs/{id}/events
  of a job submitted without it yields the `end` event alone (its output is in the job body).
  A JSON null for an optional field means its default. Text prompts are encoded with the model's
  special tokens (e.g. BOS); token-id prompts are queued exactly as given.
"""
