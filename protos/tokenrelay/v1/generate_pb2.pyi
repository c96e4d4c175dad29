from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class StoppingParameters(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    class JsonSchema(_message.Message):
        __slots__ = ("schema", "strict")
        SCHEMA_FIELD_NUMBER: _ClassVar[int]
        STRICT_FIELD_NUMBER: _ClassVar[int]
        schema: str
        strict: bool
        def __init__(self, schema: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...
    class JsonObject(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class Choice(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: ResponseFormat.JsonSchema
    json_object: ResponseFormat.JsonObject
    regex: str
    grammar: str
    choice: ResponseFormat.Choice
    def __init__(self, json_schema: _Optional[_Union[ResponseFormat.JsonSchema, _Mapping]] = ..., json_object: _Optional[_Union[ResponseFormat.JsonObject, _Mapping]] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ResponseFormat.Choice, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "request_id", "sampling", "stopping", "logprobs", "top_logprobs", "truncate_prompt", "priority", "resume_from_index", "cache_salt", "response_format", "model", "adapter", "stream_interval")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    request_id: str
    sampling: SamplingParameters
    stopping: StoppingParameters
    logprobs: bool
    top_logprobs: int
    truncate_prompt: bool
    priority: int
    resume_from_index: int
    cache_salt: str
    response_format: ResponseFormat
    model: str
    adapter: str
    stream_interval: int
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., request_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., stopping: _Optional[_Union[StoppingParameters, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., truncate_prompt: _Optional[bool] = ..., priority: _Optional[int] = ..., resume_from_index: _Optional[int] = ..., cache_salt: _Optional[str] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., model: _Optional[str] = ..., adapter: _Optional[str] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "queue_time_s", "time_to_first_token_s", "decode_time_s", "seed", "truncated_prompt_tokens", "cached_prompt_tokens", "num_draft_tokens", "num_accepted_tokens", "is_constrained")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float
    time_to_first_token_s: float
    decode_time_s: float
    seed: int
    truncated_prompt_tokens: int
    cached_prompt_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    is_constrained: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_time_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., decode_time_s: _Optional[float] = ..., seed: _Optional[int] = ..., truncated_prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., is_constrained: _Optional[bool] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "text", "error_message", "worker_id", "tenant")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    text: str
    error_message: str
    worker_id: str
    tenant: str
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., text: _Optional[str] = ..., error_message: _Optional[str] = ..., worker_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: Chunk
    final: Final
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "num_running", "num_waiting", "max_num_seqs", "num_finished", "heartbeat_unix", "max_model_len", "block_size", "num_blocks", "num_free_blocks", "kv_cache_usage", "num_prefix_cache_hit_tokens", "num_prefix_cache_query_tokens", "num_preemptions", "num_parked", "weights", "num_spec_draft_tokens", "num_spec_accepted_tokens", "prefix_cache_hit_rate", "adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARKED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    num_finished: int
    heartbeat_unix: float
    max_model_len: int
    block_size: int
    num_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    num_prefix_cache_hit_tokens: int
    num_prefix_cache_query_tokens: int
    num_preemptions: int
    num_parked: int
    weights: str
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    prefix_cache_hit_rate: float
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., num_finished: _Optional[int] = ..., heartbeat_unix: _Optional[float] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_prefix_cache_hit_tokens: _Optional[int] = ..., num_prefix_cache_query_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_parked: _Optional[int] = ..., weights: _Optional[str] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("name", "adapters", "num_workers", "is_default")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    num_workers: int
    is_default: bool
    def __init__(self, name: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., num_workers: _Optional[int] = ..., is_default: _Optional[bool] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "gateway_id", "queue_depth", "max_queue_depth", "num_in_flight", "workers", "models", "tenant", "served")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    version: str
    gateway_id: str
    queue_depth: int
    max_queue_depth: int
    num_in_flight: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    models: _containers.RepeatedScalarFieldContainer[str]
    tenant: TenantInfo
    served: _containers.RepeatedCompositeFieldContainer[ServedModel]
    def __init__(self, version: _Optional[str] = ..., gateway_id: _Optional[str] = ..., queue_depth: _Optional[int] = ..., max_queue_depth: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., models: _Optional[_Iterable[str]] = ..., tenant: _Optional[_Union[TenantInfo, _Mapping]] = ..., served: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ...) -> None: ...

class TenantInfo(_message.Message):
    __slots__ = ("name", "max_concurrent", "tokens_per_minute", "max_priority", "is_admin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_concurrent: int
    tokens_per_minute: int
    max_priority: int
    is_admin: bool
    def __init__(self, name: _Optional[str] = ..., max_concurrent: _Optional[int] = ..., tokens_per_minute: _Optional[int] = ..., max_priority: _Optional[int] = ..., is_admin: _Optional[bool] = ...) -> None: ...
