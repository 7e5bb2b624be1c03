"""The rollout engine protocol and the embedded engine: batched sampling with a KV cache in PyTorch.

The embedded engine runs any Hugging Face causal LM on CPU or one GPU:
- prompts are left-padded and prefilled once, so a group costs one prefill, not G; the static
  decoder then shares each prompt's KV cache among its G samples (the HF decoder repeats it);
- each decode step feeds one token per running sequence; a sequence that stops (EOS, a stop
  string, or max_new_tokens) leaves the running batch at once, so finished sequences cost nothing;
- token ids are returned exactly as sampled, with the log-probability of each under the sampling
  distribution (rlvr.rollout.sampling).

Two decoders run the steps after the prefill: `"static"` (rlvr.rollout.static_decode: a
preallocated cache and fused projections, for Llama-family models) and `"hf"` (the model's own
forward with a `DynamicCache`, for any causal LM). `decoder="auto"` picks static where it applies.
On a CUDA device the static decoder replays each step as a CUDA graph (``cuda_graphs``).

Multi-turn rollouts: a call's prompts that share a long prefix (a group's episodes start from one
prompt) encode it once, and inside `reusing_prefixes` (the episode runner's turns) a context that
extends a prompt prefilled earlier encodes only what was added since (rlvr.rollout.prefixes).

Vision-language models: a prompt's images (`PromptMedia`) are prefilled with its ids, and the HF
decoder goes on from the cache; a model with 3-D image positions (Qwen2-VL) gets them from its
own `get_rope_index` and decodes on from each row's largest position + 1.

Partial rollouts (`offer_weights`): new weights offered while a call is sampling take over at
the next token. The running sequences are prefilled again, prompt and tokens so far, under the
new weights (their old KV cache was computed by the old ones), and sampling goes on. Each token's
log-probability is the one it was sampled with, so the learner's off-policy correction sees the
policy that really produced it; `Completion.swapped_at` says where the weights changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from rlvr.attention import exact_attention
from rlvr.data.images import batched_inputs, multimodal_positions
from rlvr.errors import EngineOutOfMemory
from rlvr.models import padded_rows, product_width, windowed_attention, with_cache
from rlvr.rollout.matched import chosen_decoder, engine_matched_plans
from rlvr.rollout.plans import Plans, product_plans
from rlvr.rollout.prefixes import PrefixPlan, PrefixStore, Stored, plan_prefixes
from rlvr.rollout.sampling import sample_tokens
from rlvr.rollout.static_decode import StaticDecoder, StepGraphs, cache_tensors, unsupported_reason
from rlvr.rollout.weights import FusedWeights, weights_unavailable
from rlvr.types import Completion, FinishReason, PromptMedia, SamplingParams

log = logging.getLogger(__name__)


_CUDNN_LOCK = threading.Lock()
_cudnn_users = 0
_cudnn_was_enabled = True


@contextmanager
def without_cudnn_attention(device: torch.device) -> Iterator[None]:
    """On a CUDA device, `scaled_dot_product_attention` without cuDNN's backend while this runs
    (PyTorch picks among the others, as it does where cuDNN is absent). cuDNN's attention builds an
    execution plan for each new shape, and a decode step's shape is new at every key length: on an
    H200 (torch 2.11) the first 128-token call at one row ran at 20 tok/s kernel by kernel and 146
    with CUDA graphs, a repeat of the same call at 83 and 362; without cuDNN both calls ran at
    87-88 and 346-348 (docs/LOG.md, session 20). The switch is PyTorch's process-wide flag (so is
    `torch.nn.attention.sdpa_kernel`'s; there is no per-thread one): it is turned off while any
    engine generates and put back as it was when the last one is done. So a learner training on
    another thread meanwhile (`dist.async_rollouts`) runs those steps without cuDNN's attention
    too, which measured level with it on the H200 past the first step, and faster on the first;
    and a user's own `sdpa_kernel` block that overlaps a generate call may leave the flag as that
    block found it. On a CPU nothing changes."""
    global _cudnn_users, _cudnn_was_enabled
    if device.type != "cuda":
        yield
        return
    with _CUDNN_LOCK:
        if _cudnn_users == 0:
            _cudnn_was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _cudnn_users += 1
    try:
        yield
    finally:
        with _CUDNN_LOCK:
            _cudnn_users -= 1
            if _cudnn_users == 0:
                torch.backends.cuda.enable_cudnn_sdp(_cudnn_was_enabled)


class Engine(Protocol):
    """What the training loop needs from a rollout engine."""

    eos_token_ids: list[int]
    pad_token_id: int
    generator: torch.Generator
    """The engine's random stream: what each call's sampling seeds are drawn from (checkpointed)."""
    @property
    def version(self) -> int | None:
        """The version of the weights it samples with (rollout workers count updates); None locally."""
        ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, progress: Callable[[int], None] | None = None, *,
        seeds: list[list[int]] | None = None,
    ) -> list[list[Completion]]:
        """`params.n` completions for each prompt (token ids), in prompt order; `progress(k)` is
        called as k more prompts finish. ``seeds[i][j]`` seeds sample j of prompt i (default:
        drawn from `generator`).

        An engine that samples from a vision-language model also takes ``media=`` (one
        `PromptMedia` or None per prompt: the images whose tokens the prompt holds); callers pass
        it only when a prompt has images, so text-only engines need not know the keyword.

        An engine that can keep a context's keys and values from one call to the next also offers
        ``reusing_prefixes()``, a context manager (EmbeddedEngine's): inside it, a prompt that
        extends an earlier call's prompt plus its sample encodes only the new tokens. The episode
        runner opens it around its turns where the engine has it; other engines need not.

        An engine that can end a call early says so with ``can_cancel = True`` and takes
        ``cancelled=``, a callable it asks between decode steps: once it answers True the call
        ends, its samples cut short (nobody will read them: `rlvr serve`'s clients that left)."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights (a no-op when the engine shares the learner's model)."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the engine logs each step (rollout workers: the weight version, restarts)."""
        ...

    def close(self) -> None:
        """Release what it holds (actors, GPU memory); the run is over."""
        ...


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocation that failed: CUDA's OutOfMemoryError, Python's MemoryError,
    or the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


class EmbeddedEngine:
    """Batched sampling with a KV cache on the local device (see module docstring)."""

    can_cancel = True
    """`generate` takes ``cancelled=`` (see `Engine.generate`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        eos_token_ids: Iterable[int],
        max_batch_size: int = 64,
        seed: int = 0,
        decoder: Literal["auto", "static", "hf"] = "auto",
        banned_token_ids: Iterable[int] = (),
        weights: str = "model",
        cuda_graphs: bool = True,
        numerics: Literal["fast", "matched"] = "fast",
    ) -> None:
        """``banned_token_ids``: tokens never sampled (a VLM's image placeholders,
        rlvr.data.images.image_token_ids: a completion holding one would stand for an image
        nobody gave); their probability goes to the others, and the log-probs are of that
        distribution, as after top-k.

        ``weights`` (`engine.dtype = "float16"` or `"int8"`): "model" decodes with the model's own
        weights; "float16" with float16 copies, "int8" with weight-only int8 ones
        (rlvr.rollout.weights.Float16, Int8; the static decoder on CPU only). The prompt's prefill always runs the model itself. The
        completions' log-probs are the engine's own, so the learner sees the difference as a
        rollout/training mismatch (`algo.offpolicy` corrects it).

        ``cuda_graphs``: on a CUDA device the static decoder replays each step as a CUDA graph
        (rlvr.rollout.static_decode); False launches its kernels one by one.

        ``numerics`` "matched" (a bf16 model on a CPU, its own weights): the engine
        computes the learner's numbers bit for bit (rlvr.rollout.matched), so its log-probs are the
        learner's; it sets the model's attention to float64 SDPA (`rlvr.attention.exact_sdpa`),
        which the learner then runs too where it trains this same model. ValueError where
        matching cannot run, saying why."""
        reason = unsupported_reason(model)
        if decoder == "static" and reason:
            raise ValueError(f"decoder='static' cannot run this model: {reason}; use decoder='hf'")
        if decoder not in ("auto", "static", "hf"):
            raise ValueError(f"decoder must be 'auto', 'static' or 'hf', not {decoder!r}")
        self.decoder = chosen_decoder(model, decoder)
        self.device = next(model.parameters()).device
        self.weights = weights
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._graphs: StepGraphs | None = None  # the captures' stream and memory pool, made at the first capture
        self._share_prefixes = windowed_attention(model) is None  # column-counted windows break on a split's padding
        self._store: PrefixStore | None = None  # prompts' keys and values, inside `reusing_prefixes`
        why = _weights_problem(weights, self.decoder, reason, self.device)
        if why is not None:
            raise ValueError(why)
        if numerics not in ("fast", "matched"):
            raise ValueError(f"numerics must be 'fast' or 'matched', not {numerics!r}")
        self.numerics = numerics
        self._plans: Plans | None = None  # matched numerics' product plans
        self._plans_threads = torch.get_num_threads()  # the thread count they were probed at
        if numerics == "matched":
            plans = engine_matched_plans(model, self.decoder, weights)
            if isinstance(plans, str):
                raise ValueError(f"matched numerics cannot run here: {plans}")
            self._plans = plans
            if not exact_attention(model):
                raise ValueError("matched numerics cannot run here: the model's class did not take float64 attention")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(set(eos_token_ids))
        banned = sorted(set(banned_token_ids))
        self._banned = torch.tensor(banned, dtype=torch.long) if banned else None
        self.max_batch_size = max_batch_size
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        # on the CPU whatever the device: a seed draws the same sample seeds on a CPU and a GPU,
        # and a checkpoint's stream (run.py's engine_rng) resumes on either
        self.generator = torch.Generator().manual_seed(seed)
        self._fused: tuple[tuple[tuple[object, ...], ...], FusedWeights] | None = None
        self.version: int | None = None
        """The weights' version, stamped on every completion (`Completion.policy_version`); set by
        whoever versions them (a rollout worker). None for the local loop's engine."""
        self._offered: tuple[dict[str, torch.Tensor], int] | None = None
        self._offer_lock = threading.Lock()
        self._busy = threading.Lock()

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.model.state_dict().items():
                param.copy_(state_dict[name])

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass

    def offer_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Weights of `version` for partial rollouts, safe to call from another thread: loaded at
        once if no call is sampling, else at the running call's next token (see module docstring)."""
        with self._offer_lock:
            self._offered = (state_dict, version)
        if self._busy.acquire(blocking=False):
            try:
                self._take_offer()
            finally:
                self._busy.release()

    def _take_offer(self) -> bool:
        """Load the offered weights, if any; True if it did."""
        with self._offer_lock:
            offered, self._offered = self._offered, None
        if offered is None:
            return False
        self.update_weights(offered[0])
        self.version = offered[1]
        return True

    def draw_seeds(self, num_prompts: int, params: SamplingParams) -> list[list[int]]:
        """One seed per sample of the next call, drawn from the engine's generator."""
        return draw_seeds(self.generator, num_prompts, params)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        progress: Callable[[int], None] | None = None,
        *,
        seeds: list[list[int]] | None = None,
        media: Sequence[PromptMedia | None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[Completion]]:
        """Sample `params.n` completions per prompt; `progress(k)` is called as prompts finish.
        ``media[i]``: prompt i's images (a vision-language model), prefilled with its ids.
        ``cancelled``: asked between decode steps; once True, every sample still running ends
        there, finish reason "length" (see `Engine.generate`).

        Each sample draws its tokens from a random stream of its own, seeded by ``seeds[i][j]``
        (by default drawn from the engine's generator, `draw_seeds`). So what a sample gets does
        not depend on which other prompts share its batch, on max_batch_size, or on which rollout
        worker runs it: a distributed engine that passes the same seeds samples what this one
        would (up to the floating-point differences of other batch shapes)."""
        if seeds is None:
            seeds = self.draw_seeds(len(prompts), params)
        if len(seeds) != len(prompts) or any(len(row) != params.n for row in seeds):
            raise ValueError(f"seeds must be {len(prompts)} rows of n = {params.n}")
        check_prompts(prompts, media)
        per_chunk = max(1, self.max_batch_size // params.n)
        out: list[list[Completion]] = []
        with self._busy, without_cudnn_attention(self.device):
            was_training = self.model.training
            self.model.eval()
            try:
                for start in range(0, len(prompts), per_chunk):
                    self._take_offer()
                    chunk = prompts[start : start + per_chunk]
                    try:
                        out += self._generate_chunk(chunk, params, seeds[start : start + per_chunk],
                                                    None if media is None else media[start : start + per_chunk],
                                                    cancelled)
                    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
                        if not out_of_memory(err):
                            raise
                        raise EngineOutOfMemory(
                            f"the rollout engine ran out of memory on {self.device} sampling {len(chunk)} prompts × "
                            f"{params.n} samples of up to {params.max_new_tokens} tokens ({type(err).__name__}: "
                            f"{str(err)[:200]}): lower engine.max_batch_size (now {self.max_batch_size}), "
                            "sampling.max_new_tokens or algo.group_size") from err
                    if progress:
                        progress(len(chunk))
            finally:
                self.model.train(was_training)
        return out

    def _decoder(self, cache: DynamicCache, mask_PT: torch.Tensor, n: int,
                 offsets_P: torch.Tensor | None = None, new_tokens: int = 0) -> StaticDecoder | HFDecoder:
        if self.numerics == "matched" and self._plans_threads != torch.get_num_threads():
            self._rematch()
        if self.decoder == "static":
            if self.cuda_graphs and self._graphs is None and self.device.type == "cuda":
                self._graphs = StepGraphs(self.device)
            return StaticDecoder(self.model, self._fused_weights(), cache, mask_PT, n, new_tokens=new_tokens,
                                 fixed_shapes=self.cuda_graphs, graphs=self._graphs if self.cuda_graphs else None,
                                 exact=self.numerics == "matched")
        return HFDecoder(self.model, cache, mask_PT, n, offsets_P)

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[list[int]],
        media: Sequence[PromptMedia | None] | None = None, cancelled: Callable[[], bool] | None = None,
    ) -> list[list[Completion]]:
        n, eos = params.n, torch.tensor(self.eos_token_ids, device=self.device)
        uniforms_BT = self._uniforms(params, seeds)
        cache, logits_PV, mask_PT, offsets_P = self._prefill(prompts, media)
        logits = logits_PV.repeat_interleave(n, 0)
        decoder = self._decoder(cache, mask_PT, n, offsets_P, params.max_new_tokens)
        del cache
        version = self.version
        swapped_at: list[list[int]] = [[] for _ in range(len(prompts) * n)]
        rows = torch.arange(len(prompts) * n, device=self.device)  # which sample each running row is
        tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
        logps: list[list[float]] = [[] for _ in range(len(prompts) * n)]
        reasons: list[FinishReason] = ["length"] * (len(prompts) * n)
        max_stop = max((len(s.encode("utf-8")) for s in params.stop), default=0)
        banned = None if self._banned is None else self._banned.to(self.device)
        for step in range(params.max_new_tokens):
            if banned is not None:
                logits = logits.index_fill(-1, banned, float("-inf"))
            tok_B, lp_B = sample_tokens(
                logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                uniforms_B=uniforms_BT[rows, step],
            )
            done_B = torch.isin(tok_B, eos)
            for r, t, lp in zip(rows.tolist(), tok_B.tolist(), lp_B.tolist()):
                tokens[r].append(t)
                logps[r].append(lp)
            if max_stop:
                done_B |= self._hit_stop(rows, tokens, params.stop, max_stop)
            for r in rows[done_B].tolist():
                reasons[r] = "stop"
            if step == params.max_new_tokens - 1 or (cancelled is not None and cancelled()):
                break
            keep_B = ~done_B
            if not keep_B.any():
                break
            if not keep_B.all():  # finished sequences leave the running batch
                idx = keep_B.nonzero().squeeze(-1)
                decoder.keep(idx)
                rows, tok_B = rows[idx], tok_B[idx]
            if self._offered is not None and self._take_offer():  # partial rollouts: newer weights go on from here
                for r in rows.tolist():
                    swapped_at[r].append(step + 1)
                decoder, logits = self._reprefill(prompts, tokens, rows.tolist(), n, media,
                                                  params.max_new_tokens - step - 1)
                continue
            logits = decoder.step(tok_B)
        return [
            [self._completion(tokens[i * n + j], logps[i * n + j], reasons[i * n + j], version, swapped_at[i * n + j])
             for j in range(n)]
            for i in range(len(prompts))
        ]

    def _uniforms(self, params: SamplingParams, seeds: list[list[int]]) -> torch.Tensor:
        """Each sample's uniforms for every step, from its own seed's stream (inverse-CDF sampling
        takes one per token), so a sample does not depend on what else is in the batch."""
        return torch.stack([
            torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            if params.temperature > 0 else torch.zeros(params.max_new_tokens, dtype=torch.float64)
            for row in seeds for seed in row]).to(self.device)

    def _reprefill(self, prompts: list[list[int]], tokens: list[list[int]], running: list[int], n: int,
                   media: Sequence[PromptMedia | None] | None,
                   new_tokens: int = 0) -> tuple[StaticDecoder | HFDecoder, torch.Tensor]:
        """A decoder for the running samples under newly taken weights: each sample's prompt and
        tokens so far prefilled again, one row per sample; and the rows' next-token logits.
        ``new_tokens``: the most any of them may still sample."""
        cache, logits, mask_RT, offsets_R = self._prefill(
            [prompts[r // n] + tokens[r] for r in running],
            None if media is None else [media[r // n] for r in running])
        return self._decoder(cache, mask_RT, 1, offsets_R, new_tokens), logits

    def _prefill(self, prompts: list[list[int]], media: Sequence[PromptMedia | None] | None = None,
                 ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Prefill each prompt once (the decoders repeat the cache for the n samples), with the
        pixel inputs of the prompts that have images: the model fills their image tokens.

        Returns (cache, next-token logits_PV, attention mask_PT, position offsets_P). Prompts are
        left-padded; positions count real tokens only, as in the learner's right-padded rows. A
        model with 3-D image positions (Qwen2-VL) gets them from its own `get_rope_index`, and
        offsets_P says how far each row's next position is from its length (None: not at all).

        Text prompts are encoded in two parts where that saves work (rlvr.rollout.prefixes): a
        prefix whose keys and values are already known (inside `reusing_prefixes`: a prompt
        prefilled earlier that this one extends) or shared with other prompts of the call (the
        episodes of a group start from one prompt), then each prompt's own suffix. The mask then
        has padding between a row's prefix and its suffix.
        """
        if media is not None and any(m is not None for m in media) or not self._share_prefixes:
            return self._prefill_whole(prompts, media)
        store = self._store
        if store is not None:
            store.check_weights(self._weights_key())
        hits = [store.take(p) if store is not None else None for p in prompts]
        rest = [i for i, hit in enumerate(hits) if hit is None]
        plan = plan_prefixes([prompts[i] for i in rest]) if len(rest) > 1 else None
        if plan is None and len(rest) == len(prompts):
            out = self._prefill_whole(prompts)
        else:
            out = self._prefill_split(prompts, hits, rest, plan)
        if store is not None:
            store.put(prompts, *cache_tensors(out[0]), out[2])
        return out

    def _prefill_split(self, prompts: list[list[int]], hits: list[Stored | None], rest: list[int],
                       plan: PrefixPlan | None) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, None]:
        """`_prefill` in two parts: each prompt's prefix keys and values, from the store (``hits``)
        or from one prefill of the shared prefixes of the ``rest`` (``plan``), gathered into one
        left-padded cache; then every prompt's suffix, encoded after it."""
        cut = [hit.length if hit is not None else 0 for hit in hits]
        sources: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[int]]] = []
        if plan is not None:
            shared, _, shared_mask, _ = self._prefill_whole(plan.prefixes)
            sources.append((rest, *cache_tensors(shared), shared_mask, plan.owner))
            for j, i in enumerate(rest):
                cut[i] = plan.cut(j)
        batches: dict[int, tuple[Any, list[int], list[int]]] = {}
        for i, hit in enumerate(hits):
            if hit is not None:
                entry = batches.setdefault(id(hit.batch), (hit.batch, [], []))
                entry[1].append(i)
                entry[2].append(hit.row)
        sources += [(dst, batch.keys, batch.values, batch.mask_PT, src) for batch, dst, src in batches.values()]
        width = max(source[3].shape[1] for source in sources)
        like = sources[0][1]
        keys = [k.new_zeros((len(prompts), k.shape[1], width, k.shape[3])) for k in like]
        values = [k.new_zeros((len(prompts), k.shape[1], width, k.shape[3])) for k in sources[0][2]]
        prefix_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        for dst, src_keys, src_values, src_mask, src in sources:
            to, of, w = torch.tensor(dst, device=self.device), torch.tensor(src, device=self.device), src_mask.shape[1]
            for k, v, sk, sv in zip(keys, values, src_keys, src_values):
                k[to, :, width - w:] = sk[of]
                v[to, :, width - w:] = sv[of]
            prefix_mask[to, width - w:] = src_mask[of]
        cache = _cache_of(keys, values)
        del keys, values, sources
        ids_PS, suffix_mask_PS = self._left_padded([p[cut[i]:] for i, p in enumerate(prompts)])
        mask_PT = torch.cat([prefix_mask, suffix_mask_PS], 1)
        pos_PS = (mask_PT.cumsum(-1) - 1).clamp(min=0)[:, -ids_PS.shape[1]:]
        logits = self.model(
            input_ids=ids_PS, attention_mask=mask_PT, position_ids=pos_PS, logits_to_keep=1,
            **with_cache(self.model, cache),
        ).logits[:, -1]
        cache, mask_PT = _closed_up(cache, mask_PT)
        return cache, logits, mask_PT, None

    @contextmanager
    def reusing_prefixes(self) -> Iterator[None]:
        """Inside, each call keeps its prompts' keys and values, and a later prompt that extends
        one of them encodes only what it adds (rlvr.rollout.prefixes.PrefixStore): the turns of
        a multi-turn rollout (rlvr.agents.runner). Changed weights invalidate what is kept."""
        outer, self._store = self._store, PrefixStore()
        try:
            yield
        finally:
            self._store = outer

    def _weights_key(self) -> tuple[tuple[object, ...], ...]:
        """Changes whenever a parameter does: every in-place change to a tensor (an optimizer
        step, `load_state_dict`, `copy_`) bumps its version counter, and a parameter given new
        storage (`p.data = ...`, `module.to(...)`) changes its address, dtype or device."""
        return tuple((id(p), p._version, p.data_ptr(), p.dtype, p.device) for p in self.model.parameters())

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask, left-padded to the longest prompt, on the device; at least
        `FEWEST_ROWS` tokens in all (one short prompt alone, a multi-turn turn's short suffix), so
        the prefill's products round as the learner's do (`product_width`)."""
        longest = max(map(len, prompts))
        ids_PT, mask_PT = padded_rows(prompts, self.pad_token_id, left=True, width=product_width(len(prompts), longest))
        return ids_PT.to(self.device), mask_PT.to(self.device)

    def _prefill_whole(self, prompts: list[list[int]], media: Sequence[PromptMedia | None] | None = None,
                       ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`_prefill` without shared prefixes: each prompt encoded whole, one left-padded batch."""
        ids_PT, mask_PT = self._left_padded(prompts)
        width = ids_PT.shape[1]
        images = batched_inputs(media or (), self.device, self.model.dtype, starts=[width - len(p) for p in prompts],
                                width=width)
        grid = multimodal_positions(self.model, ids_PT, mask_PT, images)
        pos = (mask_PT.cumsum(-1) - 1).clamp(min=0) if grid is None else grid
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids_PT, attention_mask=mask_PT, position_ids=pos, logits_to_keep=1,
            **with_cache(self.model, cache), **images,
        ).logits[:, -1]
        offsets = None if grid is None else grid.amax(dim=(0, 2)) + 1 - mask_PT.sum(-1)
        return cache, logits, mask_PT, offsets

    @torch.no_grad()
    def _fused_weights(self) -> FusedWeights:
        """The static decoder's weight copies, rebuilt only when a parameter has changed
        (`_weights_key`)."""
        versions = self._weights_key()
        if self._fused is None or self._fused[0] != versions:
            self._fused = None  # free the old copies before making new ones
            self._fused = (versions, FusedWeights(self.model, self.weights, plans=self._plans))
        return self._fused[1]

    def _rematch(self) -> None:
        """Matched numerics after torch's thread count changed (rlvr.cores fits it to the free cores
        between steps): the forms that give the learner's bits are probed again for the new count
        (oneDNN may split a product otherwise); where none does, the decoder runs the fastest
        forms until the count comes back, and says so."""
        threads = torch.get_num_threads()
        plans = engine_matched_plans(self.model, self.decoder, self.weights)
        if isinstance(plans, str):
            log.warning("matched numerics are off while torch runs %d threads: %s; the engine's log-probs now "
                        "differ from the learner's by bf16 rounding (mismatch_logratio_abs says how much)",
                        threads, plans)
            plans = product_plans(self.model)
        if plans != self._plans:
            self._fused = None  # the decoder's weights in the new plans' forms
        self._plans, self._plans_threads = plans, threads

    def _hit_stop(self, rows: torch.Tensor, tokens: list[list[int]], stop: tuple[str, ...], max_stop: int) -> torch.Tensor:
        # A token holds at least one byte of text (byte-level BPE splits a character across
        # tokens), so the last max_stop tokens, max_stop the longest stop string's UTF-8 length,
        # hold any stop string that the newest token completed.
        # ...in the text the completion will have: special tokens skipped, as in `_completion`
        # ("_" or "im" must not stop on a sampled <|im_start|>)
        hits = [any(s in self.tokenizer.decode(tokens[r][-max_stop:], skip_special_tokens=True) for s in stop)
                for r in rows.tolist()]
        return torch.tensor(hits, device=self.device)

    def _completion(self, ids: list[int], logps: list[float], reason: FinishReason, version: int | None,
                    swapped_at: list[int]) -> Completion:
        return Completion(
            token_ids=tuple(ids), logprobs=tuple(logps), finish_reason=reason,
            text=str(self.tokenizer.decode(ids, skip_special_tokens=True)),
            policy_version=version, swapped_at=tuple(swapped_at),
        )


def _weights_problem(weights: str, decoder: str, reason: str | None, device: torch.device) -> str | None:
    """Why the decoder's weight format `weights` cannot run with this decoder on this device
    (``reason``: why the static decoder cannot run the model, if it cannot), or None."""
    if weights == "model":
        return None
    why = weights_unavailable(weights)
    if why is None and decoder != "static":
        why = (f"engine.dtype = {weights!r} runs in the static decoder, which "
               f"{'this model cannot use: ' + str(reason) if reason else 'decoder=hf turns off'}")
    if why is None and device.type != "cpu":
        why = f"engine.dtype = {weights!r} runs CPU kernels; on a GPU use bfloat16 or float32 (or train.device = \"cpu\")"
    return why


def check_prompts(prompts: Sequence[Sequence[int]], media: Sequence[Any] | None = None) -> None:
    """What every engine refuses before it generates: an empty prompt, and images not given one
    entry (or None) per prompt."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("cannot generate from an empty prompt")
    if media is not None and len(media) != len(prompts):
        raise ValueError(f"media must give one entry (or None) per prompt: {len(media)} for {len(prompts)} prompts")


def draw_seeds(generator: torch.Generator, num_prompts: int, params: SamplingParams) -> list[list[int]]:
    """num_prompts rows of params.n sample seeds from ``generator`` (what an engine's next call
    uses). Greedy decoding (temperature 0) draws nothing and gets zeros, so an evaluation between
    training steps leaves the training stream as it was."""
    if params.temperature == 0:
        return [[0] * params.n for _ in range(num_prompts)]
    return torch.randint(0, 2**62, (num_prompts, params.n), generator=generator, device=generator.device).tolist()


def _cache_of(keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache


def _closed_up(cache: DynamicCache, mask_PT: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """The cache with each row's real columns moved to the right and the padding between them
    cut: after a split prefill the padding between prefix and suffix would otherwise add up
    turn after turn (each turn's width is the widest prefix plus the longest suffix). Keys
    already hold their rotary positions and the next positions come from the mask's sums, so
    moving columns changes nothing but the width."""
    width = int(mask_PT.sum(-1).max())
    if width == mask_PT.shape[1]:
        return cache, mask_PT
    order_PT = torch.sort(mask_PT, dim=1, stable=True).indices[:, -width:]  # pads first, then the real columns in order
    tensors = cache_tensors(cache)

    def gather(t: torch.Tensor) -> torch.Tensor:  # P,kv,T,D
        return t.gather(2, order_PT[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))

    return _cache_of([gather(k) for k in tensors[0]], [gather(v) for v in tensors[1]]), mask_PT.gather(1, order_PT)


class HFDecoder:
    """Decode steps through the model's own forward and a `DynamicCache`: works for any causal LM."""

    def __init__(self, model: PreTrainedModel, cache: DynamicCache, mask_PT: torch.Tensor, n: int,
                 offsets_P: torch.Tensor | None = None) -> None:
        """`cache` and `mask_PT` hold one row per prompt; each is repeated for its n samples.
        ``offsets_P``: how far each prompt's next position is from its length (3-D image
        positions run ahead of or behind the token count)."""
        if n > 1:
            cache.batch_repeat_interleave(n)
        self.model, self.cache, self.mask_BT = model, cache, mask_PT.repeat_interleave(n, 0)
        self.next_pos_B = self.mask_BT.sum(-1)
        if offsets_P is not None:
            self.next_pos_B = self.next_pos_B + offsets_P.repeat_interleave(n, 0)

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only running rows `idx`."""
        self.cache.batch_select_indices(idx)
        self.mask_BT, self.next_pos_B = self.mask_BT[idx], self.next_pos_B[idx]

    def step(self, tok_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per running row; return the next-token logits."""
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones(len(tok_B), 1)], dim=-1)
        logits = self.model(
            input_ids=tok_B[:, None], attention_mask=self.mask_BT, position_ids=self.next_pos_B[:, None],
            **with_cache(self.model, self.cache),
        ).logits[:, -1]
        self.next_pos_B = self.next_pos_B + 1
        return logits
