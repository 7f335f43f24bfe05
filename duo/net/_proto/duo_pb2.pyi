from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verification(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDUAL: _ClassVar[Verification]
    COUPLED: _ClassVar[Verification]
RESIDUAL: Verification
COUPLED: Verification

class JoinUp(_message.Message):
    __slots__ = ("hello", "event")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    event: DraftEvent
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., event: _Optional[_Union[DraftEvent, _Mapping]] = ...) -> None: ...

class JoinDown(_message.Message):
    __slots__ = ("hello", "event")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    event: TargetEvent
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., event: _Optional[_Union[TargetEvent, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol", "model", "vocab")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    model: str
    vocab: Vocab
    def __init__(self, protocol: _Optional[str] = ..., model: _Optional[str] = ..., vocab: _Optional[_Union[Vocab, _Mapping]] = ...) -> None: ...

class Vocab(_message.Message):
    __slots__ = ("vocab_type", "bos", "eos", "add_bos", "add_eos", "token_texts")
    VOCAB_TYPE_FIELD_NUMBER: _ClassVar[int]
    BOS_FIELD_NUMBER: _ClassVar[int]
    EOS_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    ADD_EOS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    vocab_type: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    token_texts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, vocab_type: _Optional[int] = ..., bos: _Optional[int] = ..., eos: _Optional[int] = ..., add_bos: _Optional[bool] = ..., add_eos: _Optional[bool] = ..., token_texts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n", "logit_bias", "infill", "typical_p", "top_n_sigma", "min_keep", "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "mirostat", "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "sampler_order")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_LAST_N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INFILL_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    TOP_N_SIGMA_FIELD_NUMBER: _ClassVar[int]
    MIN_KEEP_FIELD_NUMBER: _ClassVar[int]
    XTC_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    XTC_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DYNATEMP_RANGE_FIELD_NUMBER: _ClassVar[int]
    DYNATEMP_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    MIROSTAT_FIELD_NUMBER: _ClassVar[int]
    MIROSTAT_TAU_FIELD_NUMBER: _ClassVar[int]
    MIROSTAT_ETA_FIELD_NUMBER: _ClassVar[int]
    DRY_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    DRY_BASE_FIELD_NUMBER: _ClassVar[int]
    DRY_ALLOWED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRY_PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    DRY_SEQUENCE_BREAKERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ORDER_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repeat_penalty: float
    repeat_last_n: int
    logit_bias: _containers.ScalarMap[int, float]
    infill: bool
    typical_p: float
    top_n_sigma: float
    min_keep: int
    xtc_probability: float
    xtc_threshold: float
    dynatemp_range: float
    dynatemp_exponent: float
    mirostat: int
    mirostat_tau: float
    mirostat_eta: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_sequence_breakers: _containers.RepeatedScalarFieldContainer[str]
    sampler_order: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., infill: _Optional[bool] = ..., typical_p: _Optional[float] = ..., top_n_sigma: _Optional[float] = ..., min_keep: _Optional[int] = ..., xtc_probability: _Optional[float] = ..., xtc_threshold: _Optional[float] = ..., dynatemp_range: _Optional[float] = ..., dynatemp_exponent: _Optional[float] = ..., mirostat: _Optional[int] = ..., mirostat_tau: _Optional[float] = ..., mirostat_eta: _Optional[float] = ..., dry_multiplier: _Optional[float] = ..., dry_base: _Optional[float] = ..., dry_allowed_length: _Optional[int] = ..., dry_penalty_last_n: _Optional[int] = ..., dry_sequence_breakers: _Optional[_Iterable[str]] = ..., sampler_order: _Optional[str] = ...) -> None: ...

class TargetEvent(_message.Message):
    __slots__ = ("open", "commit", "steer", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    STEER_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    commit: Commit
    steer: Steer
    close: CloseSession
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., steer: _Optional[_Union[Steer, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "committed", "sampling", "max_ahead", "p_min", "verification", "grammar", "output_start", "lookup", "mirostat_mu")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_AHEAD_FIELD_NUMBER: _ClassVar[int]
    P_MIN_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    MIROSTAT_MU_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    committed: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_ahead: int
    p_min: float
    verification: Verification
    grammar: str
    output_start: int
    lookup: bool
    mirostat_mu: float
    def __init__(self, session_id: _Optional[int] = ..., committed: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_ahead: _Optional[int] = ..., p_min: _Optional[float] = ..., verification: _Optional[_Union[Verification, str]] = ..., grammar: _Optional[str] = ..., output_start: _Optional[int] = ..., lookup: _Optional[bool] = ..., mirostat_mu: _Optional[float] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("session_id", "start", "tokens", "mirostat_mu")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIROSTAT_MU_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    mirostat_mu: float
    def __init__(self, session_id: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., mirostat_mu: _Optional[float] = ...) -> None: ...

class Steer(_message.Message):
    __slots__ = ("session_id", "max_ahead")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_AHEAD_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    max_ahead: int
    def __init__(self, session_id: _Optional[int] = ..., max_ahead: _Optional[int] = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class DraftEvent(_message.Message):
    __slots__ = ("chunk", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: DraftChunk
    error: SessionError
    def __init__(self, chunk: _Optional[_Union[DraftChunk, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class DraftChunk(_message.Message):
    __slots__ = ("session_id", "epoch", "start", "tokens", "dists", "branch_of", "paused", "confidence")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_OF_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    dists: _containers.RepeatedCompositeFieldContainer[SparseDist]
    branch_of: int
    paused: bool
    confidence: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., dists: _Optional[_Iterable[_Union[SparseDist, _Mapping]]] = ..., branch_of: _Optional[int] = ..., paused: _Optional[bool] = ..., confidence: _Optional[_Iterable[float]] = ...) -> None: ...

class SparseDist(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("session_id", "message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    message: str
    def __init__(self, session_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "max_tokens", "sampling", "stop", "cache_prompt", "grammar", "return_progress")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CACHE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    cache_prompt: bool
    grammar: Grammar
    return_progress: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., cache_prompt: _Optional[bool] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., return_progress: _Optional[bool] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "progress")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: Stats
    progress: PromptProgress
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., progress: _Optional[_Union[PromptProgress, _Mapping]] = ...) -> None: ...

class PromptProgress(_message.Message):
    __slots__ = ("total", "cache", "processed", "seconds")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    total: int
    cache: int
    processed: int
    seconds: float
    def __init__(self, total: _Optional[int] = ..., cache: _Optional[int] = ..., processed: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "draft_tokens_received", "draft_tokens_verified", "draft_tokens_accepted", "verify_steps", "tokens_per_second", "time_to_first_token_s", "draft_connected", "batch_sizes", "draft_rejections", "branch_hits", "waits", "wait_seconds", "verification", "seed", "cached_prompt_tokens", "speculation", "lookup_tokens_verified", "lookup_tokens_accepted", "lookup_tokens_decoded", "lookup_steps_rested", "lookup_trials", "lookup", "draft", "step_verify_seconds", "step_work_seconds", "step_drafts_seconds", "step_queue_seconds", "step_between_seconds", "step_check_seconds", "commit_round_trips", "commit_round_trip_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_HITS_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_DECODED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_STEPS_RESTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TRIALS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    STEP_VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_DRAFTS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_BETWEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_CHECK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ROUND_TRIPS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ROUND_TRIP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    draft_tokens_received: int
    draft_tokens_verified: int
    draft_tokens_accepted: int
    verify_steps: int
    tokens_per_second: float
    time_to_first_token_s: float
    draft_connected: bool
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    draft_rejections: int
    branch_hits: int
    waits: int
    wait_seconds: float
    verification: str
    seed: int
    cached_prompt_tokens: int
    speculation: str
    lookup_tokens_verified: int
    lookup_tokens_accepted: int
    lookup_tokens_decoded: int
    lookup_steps_rested: int
    lookup_trials: int
    lookup: str
    draft: str
    step_verify_seconds: float
    step_work_seconds: float
    step_drafts_seconds: float
    step_queue_seconds: float
    step_between_seconds: float
    step_check_seconds: float
    commit_round_trips: int
    commit_round_trip_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., draft_tokens_received: _Optional[int] = ..., draft_tokens_verified: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., verify_steps: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., draft_connected: _Optional[bool] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., draft_rejections: _Optional[int] = ..., branch_hits: _Optional[int] = ..., waits: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., verification: _Optional[str] = ..., seed: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., speculation: _Optional[str] = ..., lookup_tokens_verified: _Optional[int] = ..., lookup_tokens_accepted: _Optional[int] = ..., lookup_tokens_decoded: _Optional[int] = ..., lookup_steps_rested: _Optional[int] = ..., lookup_trials: _Optional[int] = ..., lookup: _Optional[str] = ..., draft: _Optional[str] = ..., step_verify_seconds: _Optional[float] = ..., step_work_seconds: _Optional[float] = ..., step_drafts_seconds: _Optional[float] = ..., step_queue_seconds: _Optional[float] = ..., step_between_seconds: _Optional[float] = ..., step_check_seconds: _Optional[float] = ..., commit_round_trips: _Optional[int] = ..., commit_round_trip_seconds: _Optional[float] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "pieces")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("name", "aliases", "description", "context_size", "n_vocab", "draft", "draft_address", "parallel", "queue_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    description: str
    context_size: int
    n_vocab: int
    draft: str
    draft_address: str
    parallel: int
    queue_size: int
    def __init__(self, name: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., description: _Optional[str] = ..., context_size: _Optional[int] = ..., n_vocab: _Optional[int] = ..., draft: _Optional[str] = ..., draft_address: _Optional[str] = ..., parallel: _Optional[int] = ..., queue_size: _Optional[int] = ...) -> None: ...
