from protos.tokenrelay.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode

class QueuedRequest(_message.Message):
    __slots__ = ("request_id", "request", "enqueued_unix", "deadline_unix", "gateway_id", "result_ttl_s", "trace_context", "timeout_s", "tenant", "cache_scope")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_UNIX_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request: _generate_pb2.GenerateRequest
    enqueued_unix: float
    deadline_unix: float
    gateway_id: str
    result_ttl_s: float
    trace_context: _containers.ScalarMap[str, str]
    timeout_s: float
    tenant: str
    cache_scope: bytes
    def __init__(self, request_id: _Optional[str] = ..., request: _Optional[_Union[_generate_pb2.GenerateRequest, _Mapping]] = ..., enqueued_unix: _Optional[float] = ..., deadline_unix: _Optional[float] = ..., gateway_id: _Optional[str] = ..., result_ttl_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., timeout_s: _Optional[float] = ..., tenant: _Optional[str] = ..., cache_scope: _Optional[bytes] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "seq", "chunk", "final", "error", "entry_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    chunk: _generate_pb2.Chunk
    final: _generate_pb2.Final
    error: RequestError
    entry_id: bytes
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., chunk: _Optional[_Union[_generate_pb2.Chunk, _Mapping]] = ..., final: _Optional[_Union[_generate_pb2.Final, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., entry_id: _Optional[bytes] = ...) -> None: ...

class TokenEventBatch(_message.Message):
    __slots__ = ("worker_id", "events", "admitted", "room")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    admitted: _containers.RepeatedScalarFieldContainer[str]
    room: int
    def __init__(self, worker_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ..., admitted: _Optional[_Iterable[str]] = ..., room: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_id", "reason", "entry_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    entry_id: bytes
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., entry_id: _Optional[bytes] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("seed", "first_token_unix", "worker_id")
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    seed: int
    first_token_unix: float
    worker_id: str
    def __init__(self, seed: _Optional[int] = ..., first_token_unix: _Optional[float] = ..., worker_id: _Optional[str] = ...) -> None: ...
