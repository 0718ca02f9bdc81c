"""One rank: owns its weight shards and KV tensors, executes the broadcast steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qual.runtime import spec_decode
from qual.runtime.backends import parse_backend
from qual.errors import QualError
from qual.options import DTYPES
from qual.runtime.config import EngineConfig
from qual.runtime.models.base import DraftMeta, ModelOptions, TargetMeta
from qual.runtime.cache_views import StepShape, draft_mask
from qual.runtime.paged import key_view, write_slots
from qual.runtime.parallel import Comm
from qual.runtime.phases import OFF
from qual.runtime.prefill import prefill
from qual.runtime.rank_caches import RankCaches
from qual.runtime.registry import ModelSpec
from qual.runtime.step_args import (NUMBERS, Readback, StepArgs, Stager, context_rows, decode_args, join_table, retire,
                                    to_device)
from qual.runtime.steps import DecodeStep, PrefillStep, StepOutput


@dataclass
class DecodeInputs:
    """Device tensors one decode step reads (static buffers when replayed from a CUDA graph)."""

    last_tokens: torch.Tensor  # [P]
    positions: torch.Tensor  # [P*Q] verify positions
    target: TargetMeta
    draft: DraftMeta | None = None
    ctx_features: torch.Tensor | None = None  # [Tc, n*hidden]


TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # qual.options names them as torch does


class ModelRunner:
    """Executes prefill / decode steps on this rank."""

    def __init__(self, cfg: EngineConfig, comm: Comm, target_spec: ModelSpec, draft_spec: ModelSpec | None):
        self.cfg, self.comm = cfg, comm
        self.phases = OFF  # the engine's timer on rank 0 when phase times are on
        dtype = TORCH_DTYPES[cfg.dtype]
        self.backend = parse_backend(cfg.backend)
        if comm.device.type == "cuda":
            self.backend.check_device(comm.device)
        self.draft_cfg = draft_spec.config if draft_spec else None
        aux = self.draft_cfg.aux_layer_ids if self.draft_cfg else ()
        target_cls = target_spec.model_class
        if self.backend.layer_part and not getattr(target_cls, "serves_fused_layer", False):
            raise QualError(f"backend {cfg.backend}: {self.backend.layer_part} runs Qwen3 targets' layers only (target "
                            f"{target_cls.__name__})")
        options = ModelOptions(dsa_topk=cfg.dsa_topk, numerics=cfg.numerics)
        self.target = target_cls(target_spec.path, target_spec.config, comm, dtype, aux, self.backend, options)
        if self.backend.fused_decode:
            from qual.runtime.backends.fused_decode import FusedDecode

            self.target.fused = FusedDecode(self.target)
        nbytes = torch.tensor([], dtype=dtype).element_size()
        K = self.K = (cfg.num_speculative_tokens or (draft_spec.config.block_size - 1)) if draft_spec else 0
        target_groups = target_cls.cache_groups(target_spec.config, comm, nbytes, K)
        self.drafter, draft_groups = None, []
        if draft_spec:
            draft_cls = draft_spec.model_class
            self.drafter = draft_cls(draft_spec.path, draft_spec.config, comm, dtype, self.target)
            draft_groups = draft_cls.cache_groups(draft_spec.config, comm, nbytes, cfg.draft_kv, cfg.cache.draft_window)
        self.caches = RankCaches(cfg, comm, target_groups, draft_groups, K, dtype,
                                 lambda group: self.target.state_parts(group))
        # request -> aux features not yet in the draft cache: (its last step's aux rows, where its rows begin there),
        # sliced where they are used (a non-advanced step's context) rather than for every request every launch
        self.pending: dict[str, tuple[torch.Tensor, int]] = {}
        self.last_aux: torch.Tensor | None = None  # the last static launch's aux features, its requests' rows
        self.first_tokens: torch.Tensor | None = None  # [n] the last prefill's greedy choices (rank 0)
        if self.draft_cfg:
            self.mask_tokens = torch.full((1,), self.draft_cfg.mask_token_id, dtype=torch.long, device=comm.device)
        self._row_index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # P -> (rows, q_index) of a decode step
        # A static-shape step whole (views, draft + verify, the next step's inputs): compiled, its ~100 small view
        # kernels fuse with the model's elementwise work
        self.step_fn = self.backend.compile(self.static_step) if self.backend.compile_mode else self.static_step
        self.stager = Stager(comm.device)
        self.readback = Readback(comm.device)
        # One rank: the proposals' agreement with the target's choices (rank 0's alone) is known where the step ran.
        static = cfg.static_shapes or bool(cfg.cuda_graph_sizes and comm.device.type == "cuda")
        self.async_decode = cfg.async_decode and static and comm.tp_size == 1
        # Steps a launch may run: several only where the device advances each step's inputs itself
        self.steps_per_launch = cfg.steps_per_launch if self.async_decode else 1
        # Padded size -> (the last step's arguments, views of its input buffer (their .flat); its draft context buffer)
        self._static_inputs: dict[int, tuple[StepArgs, torch.Tensor | None]] = {}
        self.graphs = None
        if cfg.cuda_graph_sizes and comm.device.type == "cuda":
            from qual.runtime.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, cfg.cuda_graph_sizes, self.steps_per_launch)
        # Prefill at padded shapes: captured where the decode graphs are, run eagerly at those shapes under
        # static_shapes (the CPU tests' view of what the graphs run)
        self.prefill_graphs = None
        if self.graphs is not None or cfg.static_shapes:
            from qual.runtime.prefill_graphs import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(self, cfg.prefill_graph_tokens, capture=self.graphs is not None)

    def close(self) -> None:
        """Release what must go before the process group does (CUDA graphs holding NCCL kernels), then the references
        back to this runner (its graphs', its step function's): its weights and KV caches go with the engine's last
        reference, not at the cycle collector's next full pass (a run's next arm starts in this process at once)."""
        self.last_aux = None
        if self.graphs is not None:
            self.graphs.release()
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
        if self.backend.compiles:
            torch._dynamo.reset()  # this runner's compiled entries would count against the next one's limit
        self.graphs = self.prefill_graphs = self.step_fn = self.target.fused = None

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.comm.device)

    @torch.inference_mode()
    def execute(self, step) -> StepOutput | None:
        for rid in step.finished:
            self.pending.pop(rid, None)
        if isinstance(step, PrefillStep):
            return prefill(self, step)
        return self._decode(step)

    def _decode(self, step: DecodeStep) -> StepOutput:
        R, n = len(step.req_ids), step.steps
        graph = self.graphs.for_batch(R, n) if self.graphs else None
        static = graph is not None or self.cfg.static_shapes
        if (step.advanced or step.first_rows or n > 1) and not (static and self.async_decode):
            raise ValueError("a decode step launched ahead, or several a launch, need async decode at static shapes")
        if graph:
            if step.tables is not None:  # else its inputs are on the device as the launch before left them
                args, feats = self.step_args(step, pad_to=graph.batch_size, static=True)
                self.phases.lap("inputs")
                self._amend(graph.load(args, feats, step.advanced).numbers, step, args.numbers, graph.feats, graph)
            logits, drafts, aux, choices = graph.replay(n)
            self.phases.lap("graph")
        elif static:  # the graphs' shapes and input buffers, eagerly (async decode advances them in place)
            P = self.padded_size(R)
            args, feats = self._load_static(P, step)
            self.rows(P)  # made before a compiled step is first traced (else traced with it)
            self.phases.lap("inputs")
            logits, drafts, aux, choices = self.static_run(args, feats, n)
            self.phases.lap("graph")
        else:
            logits, drafts, aux, choices = self._halves(self.decode_inputs(step))
            choices = None if choices is None else choices[None]
        if getattr(self.target, "fused", None) is not None:
            self.target.fused.check()  # the copy of the steps before: no wait here
        Q = 1 + self.K
        kept = None
        if aux is not None:  # one clone for the batch: graph outputs are overwritten by the next replay
            kept = aux[: R * Q].clone()
            for i, rid in enumerate(step.req_ids):
                self.pending[rid] = (kept, i * Q)
        # What the device packed the next step's draft context from (its rows past R are padding, which packs
        # nothing): the clone, not the graph's output, which no reference may hold past the graphs' release
        self.last_aux = kept if static else None
        # Started now, read when the engine commits the step: with async decode, after the next step is launched
        read = self.readback.start(choices[:, :R]) if choices is not None else None
        self.phases.lap("commit")
        return StepOutput(logits[:R], None if drafts is None else drafts[:R], read)

    def static_run(self, args: StepArgs, feats: torch.Tensor | None, n: int):
        """n static steps back to back (what an n-step CUDA graph captures): each advances the inputs the next one
        reads, so n > 1 needs async decode. The last step's (logits, drafts, aux), with every step's choices stacked
        [n, P, W] (None on ranks that do not choose)."""
        chosen = []
        for _ in range(n):
            logits, drafts, aux, choices = self.step_fn(args, feats)
            chosen.append(choices)
        if choices is None:
            return logits, drafts, aux, None
        return logits, drafts, aux, torch.stack(chosen) if n > 1 else choices[None]  # a view: no copy for one step

    def _halves(self, inp: DecodeInputs):
        """decode_compute's two halves, timed apart (eager steps)."""
        self.phases.lap("inputs")
        drafts = self.draft_compute(inp)
        self.phases.lap("draft")
        out = self.verify_compute(inp, drafts)
        self.phases.lap("verify")
        return out

    def check_kernels(self) -> None:
        """Raise if a kernel flagged a failure in any step so far (checked between steps without waiting)."""
        if getattr(self.target, "fused", None) is not None:
            self.target.fused.check(wait=True)

    def padded_size(self, batch_size: int) -> int:
        """The batch a decode step of batch_size requests runs at: its graph's size, or the static shapes' power of
        two (steps of one padded size can follow one another ahead)."""
        fit = self.graphs.fit(batch_size) if self.graphs is not None else None
        return fit or 1 << (batch_size - 1).bit_length()

    def can_launch_ahead(self, batch_size: int) -> bool:
        """Whether a decode step of batch_size requests can be launched ahead (async decode): it runs at static
        shapes, from a graph or eagerly."""
        return self.async_decode and (self.cfg.static_shapes or (self.graphs is not None and self.graphs.holds(batch_size)))

    def _load_static(self, P: int, step: DecodeStep) -> tuple[StepArgs, torch.Tensor | None]:
        """A static-shape eager step's inputs in buffers kept per padded size P, as a graph keeps its own: an advanced
        step refills only the tables (none: they stay), and its retired rows become padding."""
        if step.tables is None:
            return self._static_inputs[P]
        args, feats = self.step_args(step, P, static=True)
        if P in self._static_inputs:
            last, kept = self._static_inputs[P]
            flat = last.flat
        else:
            flat = torch.empty(args.numel, dtype=torch.long, device=self.comm.device)
            kept = None if feats is None else torch.empty_like(feats)
        if kept is not None and not step.advanced:
            kept.copy_(feats)
        sent = self.stager.send(args, into=flat, tables_only=step.advanced)
        self._amend(sent.numbers, step, args.numbers, kept)
        self._static_inputs[P] = sent, kept
        return sent, kept

    def _amend(self, numbers: torch.Tensor, step: DecodeStep, host: torch.Tensor, feats: torch.Tensor | None,
               graph=None) -> None:
        """What the host could not write into a static step's numbers, on the device: rows retired (padding from
        now on), rows that requests held ready take over (their numbers from `host`, the step's numbers as the host
        built them; the draft context `feats` packed again from the last launch's aux by the amended counts: a
        graph's captured join, else spec_decode.join_rows eagerly), and last tokens that are the last prefill's
        greedy choices (the step launched before they were read)."""
        retire(numbers, step.retired)
        if step.joined:  # the device packed the context by the finished requests' counts (spec_decode.advance)
            table = join_table(step.joined, host)
            if graph is not None:
                graph.join(table)
            else:
                spec_decode.join_rows(numbers, to_device(table, numbers.device), feats, self.last_aux, 1 + self.K)
        if step.first_rows:
            # The engine appends a prefill's requests to its batch in order: rows r0.. take picks p0.., one device copy
            # (no index tensors to send, and the host does not wait for the prefill)
            rows, picks = zip(*step.first_rows)
            r0, p0, n = rows[0], picks[0], len(rows)
            if rows != tuple(range(r0, r0 + n)) or picks != tuple(range(p0, p0 + n)):
                raise ValueError(f"first_rows {step.first_rows}: a prefill's requests must be consecutive rows, in order")
            numbers[NUMBERS.index("last_tokens"), r0 : r0 + n] = self.first_tokens[p0 : p0 + n]

    def step_args(self, step: DecodeStep, pad_to: int | None = None, static: bool = False):
        """The host-built part of a decode step: its per-request numbers and block tables (qual/runtime/step_args.py),
        and the draft context features of the tokens accepted last step (already on the device).

        pad_to adds dummy requests (nothing visible, writes to the trash slot); static fixes the tables' width and
        the context rows (P * Q) to their max_model_len bounds: together the fixed shapes a CUDA graph needs.
        """
        args = decode_args(step, pad_to or len(step.req_ids), self.K, self.caches.max_blocks if static else {}, static)
        feats, counts = None, step.commit_counts
        if self.drafter is not None and not step.advanced:  # an advanced step's context is on the device already
            width = len(self.draft_cfg.target_layer_ids) * self.draft_cfg.layers.hidden_size
            parts = [rows[at : at + c] for rid, c in zip(step.req_ids, counts) if c
                     for rows, at in (self.pending[rid],)]
            if args.num_ctx > sum(counts):  # static: a fixed number of context rows, the extra ones write to the trash slot
                parts.append(torch.zeros(args.num_ctx - sum(counts), width, dtype=self.target.dtype, device=self.comm.device))
            feats = torch.cat(parts) if parts else torch.zeros(0, width, dtype=self.target.dtype, device=self.comm.device)
        return args, feats

    def decode_inputs(self, step: DecodeStep, pad_to: int | None = None, static: bool = False) -> DecodeInputs:
        """A decode step's inputs on the device: its step_args sent there, and the views built from them."""
        args, feats = self.step_args(step, pad_to, static)
        return self.build_inputs(self.stager.send(args), feats, static)

    def build_inputs(self, args: StepArgs, feats: torch.Tensor | None, static: bool) -> DecodeInputs:
        """Every slot, view and mask of a decode step from its StepArgs, where they are (captured into the CUDA
        graph there: no host sync given static widths)."""
        P = args.numbers.shape[1]
        n = args.number("num_committed")
        rows, q_index = self.rows(P)
        positions = ((n - 1)[:, None] + q_index[0][None, :]).reshape(-1)
        counts = args.number("commit_counts")
        commit = (counts - 1).clamp(min=0)  # state after the last accepted token
        shape = StepShape(positions, rows, q_index, args.number("seq_lens"), commit)
        target = self.caches.target_meta(shape, args.tables, static=static, dense=True)
        inp = DecodeInputs(args.number("last_tokens"), positions, target)
        if self.drafter is None:
            return inp
        ctx_len = args.number("ctx_len")
        ctx_pos, ctx_rows = context_rows(counts, ctx_len, args.num_ctx)
        new_len = ctx_len + counts
        block_pos = new_len[:, None] + q_index[0][None, :]
        slots, views, masks = {}, {}, {}
        for name in self.caches.draft_groups:
            g, spec = self.caches.geometry[name], self.caches.by_name[name].spec
            table = args.tables[name]
            w = write_slots(g, ctx_pos, ctx_rows.clamp(min=0), table)
            slots[name] = self.caches.route(name, torch.where(ctx_rows >= 0, w, -1))
            # sliding layers window each query token (vLLM); a draft_window on full layers starts at the block
            per_query = spec.attention == "sliding"
            start = None if spec.window is None or per_query else new_len - spec.window
            views[name] = view = key_view(g, table, new_len, start, index=self.caches.key_index[name] if static else None)
            masks[name] = draft_mask(view, block_pos, spec.window if per_query else None, spec.causal)
        inp.draft = DraftMeta(ctx_pos, slots, views, block_pos, masks)
        inp.ctx_features = feats
        return inp

    def rows(self, P: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A P-request decode step's request row of each token [P*Q] and flat token index [P, Q], kept per P. Made
        before a graph is captured (a tensor first made inside a capture holds values only once the graph replays)
        and before a compiled step is first traced (which would otherwise trace both the making and the lookup)."""
        if P in self._row_index:
            return self._row_index[P]
        Q, device = 1 + self.K, self.comm.device
        made = (torch.arange(P, device=device).repeat_interleave(Q), torch.arange(P * Q, device=device).view(P, Q))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._row_index[P] = made
        return made

    def static_step(self, args: StepArgs, feats: torch.Tensor | None):
        """A decode step at static shapes from its arguments on the device: the views, draft + verify, and with async
        decode the next step's inputs advanced in place. What a CUDA graph captures (one compiled function under a
        compiled backend); returns decode_compute's outputs."""
        out = self.decode_compute(self.build_inputs(args, feats, static=True))
        if self.async_decode:
            spec_decode.advance(args, out[3], out[2], feats, self.K)
        return out

    def decode_compute(self, inp: DecodeInputs):
        """Device work of a decode step (what a CUDA graph captures): propose, then verify.

        Returns logits [P, Q, V], proposals [P, K] (None without a drafter), aux features [P*Q, n*H], and rank 0's
        greedy choices (spec_decode.pack_choices; None on the other ranks).
        """
        return self.verify_compute(inp, self.draft_compute(inp))

    def draft_compute(self, inp: DecodeInputs) -> torch.Tensor | None:
        """The drafter's proposals [P, K] (None without a drafter)."""
        if self.drafter is None:
            return None
        return spec_decode.propose(self.drafter, self.target, self.comm, self.K, inp.ctx_features, inp.last_tokens,
                                   self.mask_tokens, inp.draft, self.caches.stores, self.caches.layer_slots)

    def verify_compute(self, inp: DecodeInputs, drafts: torch.Tensor | None):
        """The target over [last, drafts]: logits [P, Q, V], the proposals again, aux features [P*Q, n*H], choices."""
        P = inp.last_tokens.shape[0]
        tokens = spec_decode.verify_tokens(inp.last_tokens, drafts)
        hidden, aux = self.target.forward(tokens.reshape(-1), inp.positions, inp.target, self.caches.stores)
        if self.comm.rank != 0:  # only rank 0 chooses: the other ranks skip the LM head
            return hidden[:P], drafts, aux, None
        logits = self.target.logits(hidden).view(P, tokens.shape[1], -1)
        return logits, drafts, aux, spec_decode.pack_choices(logits, drafts)
