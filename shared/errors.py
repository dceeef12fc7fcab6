"""Machine-readable error codes shared by the gateway (HTTP errors) and the worker (failed jobs)."""

from enum import StrEnum


class ErrorCode(StrEnum):
    # client mistakes (4xx)
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"  # a field has the wrong type or value; the message names it
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    TENANT_DISABLED = "tenant_disabled"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    ADAPTER_NOT_FOUND = "adapter_not_found"
    ADAPTER_MODEL_MISMATCH = "adapter_model_mismatch"
    JOB_NOT_FOUND = "job_not_found"
    TENANT_NOT_FOUND = "tenant_not_found"
    EMPTY_PROMPT = "empty_prompt"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_TOKEN_ID = "invalid_token_id"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    QUEUE_FULL = "queue_full"
    RATE_LIMITED = "rate_limit_exceeded"  # a tenant's requests/min, tokens/min or concurrent-jobs limit
    NO_CHAT_TEMPLATE = "chat_template_missing"  # chat completion on a model without a chat template
    INVALID_CHAT_TEMPLATE = "invalid_chat_template"  # the model's template failed to render these messages
    COMPLETION_TIMEOUT = "completion_timeout"  # a blocking completion outlived limits.max_completion_s
    MODEL_UNAVAILABLE = "model_unavailable"  # a known model that no live worker has served for a while
    # no Redis replica confirmed a new job in time: it was withdrawn, never queued (docs/reliability.md)
    REPLICA_UNAVAILABLE = "replica_unavailable"
    REDIS_UNAVAILABLE = "redis_unavailable"  # Redis unreachable past the client's retries (a failover too long)
    ADMIN_DISABLED = "admin_disabled"  # the gateway has no admin key configured
    WEBHOOK_NOT_ALLOWED = "webhook_not_allowed"  # a webhook URL off the allow-list (or webhooks are off)
    TENANT_NAME_RESERVED = "tenant_name_reserved"  # a name with a meaning of its own ("shared")
    # files and batches (gateway/files.py, gateway/batches.py)
    INVALID_MULTIPART = "invalid_multipart"  # not a multipart/form-data body, or no `file` part in it
    INVALID_PURPOSE = "invalid_purpose"  # a file upload's purpose other than `batch`
    FILE_TOO_LARGE = "file_too_large"  # over the gateway's batches.max_file_bytes
    FILE_TOO_MANY_LINES = "file_too_many_lines"  # over batches.max_file_lines requests
    INVALID_FILE_ENCODING = "invalid_file_encoding"  # not UTF-8
    INVALID_JSONL = "invalid_jsonl"  # a line that is no JSON object with a unique custom_id; the message names it
    EMPTY_FILE = "empty_file"
    FILE_QUOTA_EXCEEDED = "file_quota_exceeded"  # the tenant keeps batches.max_files_per_tenant uploads already
    FILE_NOT_FOUND = "file_not_found"
    BATCH_NOT_FOUND = "batch_not_found"
    BATCH_EXPIRED = "batch_expired"  # a batch line not run within the batch's completion window
    BATCH_CANCELLED = "batch_cancelled"
    # adapter validation (shared/adapter_paths.py, adapter_config.py, safetensors_table.py, adapter_format.py)
    INVALID_ADAPTER = "invalid_adapter"  # LoRA matrices missing, unpaired or incomplete
    INVALID_ADAPTER_PATH = "invalid_adapter_path"  # empty, a NUL byte, too long, a control character
    ADAPTER_PATH_OUTSIDE_ROOT = "adapter_path_outside_root"  # '..', or an absolute path elsewhere
    ADAPTER_PATH_FORBIDDEN = "adapter_path_forbidden"  # not under the owner's own directory of the root
    ADAPTER_PATH_NOT_FOUND = "adapter_path_not_found"  # no directory there (under the owner's own directory)
    ADAPTER_SYMLINK = "adapter_symlink"  # a symlink at some level below the adapter root
    ADAPTER_FILE_MISSING = "adapter_file_missing"  # no adapter_config.json / adapter_model.safetensors
    ADAPTER_FILE_NOT_REGULAR = "adapter_file_not_regular"  # a FIFO, device, directory … or a hard link
    INVALID_ADAPTER_CONFIG = "invalid_adapter_config"  # adapter_config.json unreadable, too large or deep, bad values
    ADAPTER_CONFIG_MISMATCH = "adapter_config_mismatch"  # target_modules / target_parameters disagree with the weights
    INVALID_SAFETENSORS = "invalid_safetensors"  # header, offsets or data length of the weights file
    ADAPTER_DTYPE_UNSUPPORTED = "adapter_dtype_unsupported"  # weights not F16, BF16 or F32
    ADAPTER_UNSUPPORTED = "adapter_unsupported"
    ADAPTER_RANK_TOO_LARGE = "adapter_rank_too_large"
    ADAPTER_SHAPE_MISMATCH = "adapter_shape_mismatch"
    ADAPTER_TOO_LARGE = "adapter_too_large"
    # valid, but over what the model's workers can serve (their --max-lora-rank, their LoRA slots)
    ADAPTER_EXCEEDS_MODEL_LIMITS = "adapter_exceeds_model_limits"
    # failures on the worker side (job.error.code)
    ADAPTER_LOAD_FAILED = "adapter_load_failed"
    NUMERICAL_ERROR = "numerical_error"
    OUT_OF_MEMORY = "out_of_memory"
    WORKER_CRASHED = "worker_crashed"
    INTERNAL_ERROR = "internal_error"
    DEADLINE_EXCEEDED = "deadline_exceeded"


class LorafleetError(Exception):
    """A failure with a machine-readable code; the gateway maps it onto an HTTP status."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
