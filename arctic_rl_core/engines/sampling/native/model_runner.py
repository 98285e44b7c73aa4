"""Runs the model for a scheduled batch: inputs, the paged KV cache, CUDA graphs for decode, sampling.

On CUDA a decode step is one host-to-device copy of a pinned staging buffer
(token ids, positions, cache slots and the attention work plan), a copy of the
last step's tokens into the token ids when the host has not read them yet
(asynchronous scheduling), one graph replay (the whole model, logits
included) and the sampler, whose tokens start back to the host without the
step waiting for them. Graphs are captured
per padded batch size, twice when FCA is on: with and without the grouped
prefix launch. The attention work plan is made with room to grow, so it serves
the steps after it until a context outgrows it or the batch changes. On CPU
everything runs eagerly and attention is the torch reference.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from arctic_rl_core.engines.runtime import clear_cublas_workspaces
from arctic_rl_core.engines.sampling.native.attention import AttentionMetadata
from arctic_rl_core.engines.sampling.native.config import EngineConfig
from arctic_rl_core.engines.sampling.native.model import CausalLM
from arctic_rl_core.engines.sampling.native.sampler import SampledTokens, Sampler, min_logits
from arctic_rl_core.engines.sampling.native.scheduler import Batch
from arctic_rl_core.engines.sampling.native.sequence import Sequence
from arctic_rl_core.engines.sampling.native.weights import load_checkpoint
from arctic_rl_core.zorro.attention.forest import PrefixForest
from arctic_rl_core.zorro.attention.plan import (
    ITEM_FIELDS,
    AttentionPlan,
    TileShape,
    decode_buffer_sizes,
    plan_decode,
    plan_prefill,
)

GiB = 1 << 30


def kv_cache_bytes(total: int, free: int, utilization: float, own: int, activations: int) -> int:
    """Bytes of KV cache for an engine given ``utilization`` of a device of ``total`` bytes.

    As vLLM counts ``gpu_memory_utilization``, the share is this engine's:
    its weights and buffers (``own``) and its peak activations come out of it,
    and what the rest of its process and other processes hold (a colocated
    trainer, another engine) is theirs. The cache and the activations' peak
    must fit in what is ``free``.
    """
    share = int(total * utilization)
    budget = share - own - activations
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} ({share / GiB:.2f} GiB) does not cover this engine's "
                         f"weights and buffers ({own / GiB:.2f} GiB) and peak activations ({activations / GiB:.2f} "
                         f"GiB); expected a larger share")  # fmt: skip
    if budget > free - activations:
        raise ValueError(f"gpu_memory_utilization={utilization} asks for {budget / GiB:.2f} GiB of KV cache, but the "
                         f"device has {max(free - activations, 0) / GiB:.2f} GiB free beside this engine's peak "
                         f"activations (the rest of this process and others hold "
                         f"{max(total - free - own, 0) / GiB:.2f} GiB); expected a smaller share, or free the device")  # fmt: skip
    return budget


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeStaging:
    """A decode step's int32 inputs: pinned host arrays filled in place, copied to the device in one transfer."""

    def __init__(self, max_seqs: int, max_blocks: int, max_items: int, max_refs: int, max_rows: int, device):
        sizes = {
            "input_ids": max_seqs, "positions": max_seqs, "slots": max_seqs, "counts": 2,
            "merge_offsets": max_seqs + 1, "wide_items": max_items * ITEM_FIELDS,
            "narrow_items": max_items * ITEM_FIELDS, "query_index": max_refs, "merge_rows": max_rows,
        }  # fmt: skip
        total = sum(sizes.values())
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        self.dev = torch.zeros(total, dtype=torch.int32, device=device)
        host_np = self.host.numpy()
        self.h: dict[str, np.ndarray] = {}
        self.d: dict[str, torch.Tensor] = {}
        offset = 0
        for name, size in sizes.items():
            self.h[name] = host_np[offset : offset + size]
            self.d[name] = self.dev[offset : offset + size]
            offset += size
        self.d["wide_items"] = self.d["wide_items"].view(max_items, ITEM_FIELDS)
        self.d["narrow_items"] = self.d["narrow_items"].view(max_items, ITEM_FIELDS)
        self.tables_host = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, pin_memory=True)
        self.tables_np = self.tables_host.numpy()
        self.tables_dev = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self._row_owner: list[tuple[int, int, int] | None] = [None] * max_seqs
        self.max_items, self.max_refs, self.max_rows = max_items, max_refs, max_rows
        # The host arrays are the source of an asynchronous copy: with steps launched ahead (asynchronous
        # scheduling), the next fill waits for the last copy to have run instead of for the whole step.
        self._copied = torch.cuda.Event()
        self._copied.record()

    def reset(self) -> None:
        """Inputs graph warm-ups and captures can run on: token 0 everywhere, no KV writes, no attention work.

        (The last step's may hold pending tokens' placeholders, -1, which no embedding row has.)
        """
        self._copied.synchronize()
        for name in ("input_ids", "positions", "counts", "merge_offsets"):
            self.h[name][:] = 0
        self.h["slots"][:] = -1
        self.dev.copy_(self.host)

    def device_plan(self, num_queries: int):
        from arctic_rl_core.zorro.attention.triton_attention import DevicePlan

        d = self.d
        return DevicePlan(d["wide_items"], d["narrow_items"], d["counts"], d["query_index"],
                          d["merge_offsets"][: num_queries + 1], d["merge_rows"])  # fmt: skip

    def fill(self, seqs: list[Sequence], plan: AttentionPlan, padded: int, block_size: int) -> None:
        """Write the step's inputs and copy them to the device (pending tokens' ids are overwritten there)."""
        self._copied.synchronize()
        h = self.h
        n = len(seqs)
        lengths = [s.num_tokens for s in seqs]
        h["input_ids"][:n] = [s.last_token for s in seqs]
        h["positions"][:n] = [length - 1 for length in lengths]
        h["slots"][:n] = [
            s.block_table[(length - 1) // block_size] * block_size + (length - 1) % block_size
            for s, length in zip(seqs, lengths)
        ]
        h["input_ids"][n:padded] = 0
        h["positions"][n:padded] = 0
        h["slots"][n:padded] = -1  # padding rows write no KV
        h["counts"][:] = (len(plan.wide_items), len(plan.narrow_items))
        h["merge_offsets"][: n + 1] = plan.merge_offsets
        h["merge_offsets"][n + 1 : padded + 1] = plan.merge_offsets[-1]
        h["wide_items"][: plan.wide_items.size] = plan.wide_items.ravel()
        h["narrow_items"][: plan.narrow_items.size] = plan.narrow_items.ravel()
        h["query_index"][: len(plan.query_index)] = plan.query_index
        h["merge_rows"][: len(plan.merge_rows)] = plan.merge_rows
        for i, seq in enumerate(seqs):
            # Rows change only when a sequence moves or gains a block; rewrite just that.
            owner = self._row_owner[i]
            table = seq.block_table
            if owner is None or owner[:2] != (seq.seq_id, seq.allocations):
                self.tables_np[i, : len(table)] = table
            elif owner[2] != len(table):
                self.tables_np[i, owner[2] : len(table)] = table[owner[2] :]
            self._row_owner[i] = (seq.seq_id, seq.allocations, len(table))
        self.dev.copy_(self.host, non_blocking=True)
        self.tables_dev[:n].copy_(self.tables_host[:n], non_blocking=True)
        self._copied.record()


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        spec = config.spec
        self.device = config.device
        self.block_size = config.block_size
        # What the process's allocator held before this engine: the rest is the engine's own (_profile_num_blocks).
        self._allocated_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.model = CausalLM(spec, config.hf_config, config.max_model_len, config.dtype, self.device)
        load_checkpoint(self.model, config.model_path, self.device)
        self.sampler = Sampler(config.eos_token_ids, self.device, config.logprobs_mode == "processed_logprobs")
        self.tiles = TileShape(group=spec.num_heads // spec.num_kv_heads)
        self.kv_cache: torch.Tensor | None = None
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.graph_pool = None
        self.staging: DecodeStaging | None = None
        self._plan_cache: tuple[PrefixForest, tuple[int, ...], AttentionPlan] | None = None  # see _decode_plan
        self._lanes: int | None = None  # see _plan_lanes
        # Decode plans balanced over the kernel's lanes: on an H100, FCA at 4 groups x 16 took 20.3-20.4 us instead
        # of 20.8-21.0 (one group: the same plan). False: even chunks, whatever the lanes (for comparisons).
        self.balance_plans = True
        self.reuse_decode_plans = True  # False: plan every decode step (for comparisons)
        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.target_items = max(32, 4 * sms // spec.num_kv_heads)
            max_seqs = config.max_num_seqs
            max_items, max_rows = decode_buffer_sizes(max_seqs, self.target_items, self.tiles)
            self.staging = DecodeStaging(max_seqs, config.max_blocks_per_seq, max_items, max_rows + max_seqs,
                                         max_rows, self.device)  # fmt: skip
            from arctic_rl_core.zorro.attention.triton_attention import Workspace

            self.workspace = Workspace.allocate(max_rows, spec.num_heads, spec.head_dim, self.device, config.dtype)
            self.num_blocks = self._profile_num_blocks()
        else:
            self.num_blocks = self._cpu_num_blocks()
        self.allocate_kv_cache()
        if config.use_cuda_graphs:
            self.capture_graphs()

    # ---- KV cache -------------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        spec = self.config.spec
        itemsize = torch.tensor([], dtype=self.config.dtype).element_size()
        return 2 * spec.num_layers * self.block_size * spec.num_kv_heads * spec.head_dim * itemsize

    def allocate_kv_cache(self) -> None:
        spec = self.config.spec
        self._lanes = None  # the kernel's build depends on the cache (its offsets' width)
        self.kv_cache = torch.empty(
            spec.num_layers, 2, self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
            dtype=self.config.dtype, device=self.device,
        )  # fmt: skip

    def free_kv_cache(self) -> int:
        freed = self.kv_cache.numel() * self.kv_cache.element_size() if self.kv_cache is not None else 0
        self.drop_graphs()
        self.kv_cache = None
        return freed

    def _cpu_num_blocks(self) -> int:
        """Room for every sequence at full length, within the memory share of this host's RAM."""
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        budget = int(ram * self.config.gpu_memory_utilization) - weights
        wanted = self.config.max_num_seqs * self.config.max_blocks_per_seq
        return self._check_blocks(min(wanted, budget // self.block_bytes))

    def _profile_num_blocks(self) -> int:
        """Blocks that fit in the engine's ``gpu_memory_utilization`` of the device after its weights and a
        worst-case prefill (``kv_cache_bytes``)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup_prefill()
        torch.cuda.empty_cache()  # the prefill's activations back to the device, so that they count as free
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        current = stats["allocated_bytes.all.current"]
        own = current - self._allocated_before  # not what the process held before: other engines, a trainer
        activations = stats["allocated_bytes.all.peak"] - current
        budget = kv_cache_bytes(total, free, self.config.gpu_memory_utilization, own, activations)
        return self._check_blocks(budget // self.block_bytes)

    def _check_blocks(self, num_blocks: int) -> int:
        if num_blocks < self.config.max_blocks_per_seq:
            raise ValueError(f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves room for "
                             f"{max(num_blocks, 0)} KV blocks; one sequence of max_model_len="
                             f"{self.config.max_model_len} needs {self.config.max_blocks_per_seq}")  # fmt: skip
        return num_blocks

    def _warmup_prefill(self) -> None:
        """A prefill of the largest step, into a one-block scratch cache (no KV is kept): peak memory, and compiles."""
        config, spec = self.config, self.config.spec
        length = config.max_model_len
        full, rest = divmod(config.max_num_batched_tokens, length)
        lengths = ([length] * full + ([rest] if rest else []))[: config.max_num_seqs]
        tokens = sum(lengths)
        dev = self.device
        scratch = torch.zeros(spec.num_layers, 2, 1, self.block_size, spec.num_kv_heads, spec.head_dim,
                              dtype=config.dtype, device=dev)  # fmt: skip
        meta = self._prefill_metadata(
            lengths, lengths,
            slots=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(n, dtype=torch.int32, device=dev) for n in lengths]),
            block_tables=torch.zeros(len(lengths), config.max_blocks_per_seq, dtype=torch.int32, device=dev),
        )  # fmt: skip
        hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=dev), meta.positions, scratch, meta)
        self.model.compute_logits(hidden[torch.tensor(np.cumsum(lengths) - 1, device=dev)])
        # The largest decode batch's top-p sort is the sampler's peak.
        rows = config.max_num_seqs
        min_logits(torch.zeros(rows, spec.vocab_size, device=dev), torch.ones(rows, device=dev),
                   torch.zeros(rows, dtype=torch.int64, device=dev), torch.full((rows,), 0.9, device=dev))  # fmt: skip
        torch.cuda.synchronize(dev)

    # ---- weights --------------------------------------------------------------------------------------------
    def move_weights(self, device: torch.device) -> int:
        """Move every parameter to ``device`` (sleep level 2 and wake); returns the bytes moved."""
        self.drop_graphs()
        moved = 0
        for p in self.model.parameters():
            moved += p.numel() * p.element_size()
            p.data = p.data.to(device)
        return moved

    # ---- steps ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: Batch, previous: SampledTokens | None = None) -> SampledTokens:
        """Launch the batch's forward pass and sampling; the tokens reach the host when read.

        ``previous``: the last decode step's tokens, still on the device. They
        are this decode batch's inputs, for sequences whose newest token is
        pending: the batch is that step's again, in the same order.
        """
        if batch.is_prefill:
            logits = self._prefill(batch.seqs)
        else:
            if (previous is not None) != batch.seqs[0].has_pending_token:
                raise RuntimeError("a decode batch with pending tokens needs the step that samples them")
            logits = self._decode(batch.seqs, batch.forest, previous)
        return self.sampler(logits, batch.seqs)

    def _prefill_metadata(self, query_lens, context_lens, slots, positions, block_tables) -> AttentionMetadata:
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slots, positions=positions, block_tables=block_tables,
            context_lens=context_lens, query_lens=query_lens,
        )  # fmt: skip
        if self.device.type == "cuda":
            from arctic_rl_core.zorro.attention.triton_attention import DevicePlan

            plan = plan_prefill(query_lens, context_lens, self.tiles)
            meta.plan = DevicePlan.from_plan(plan, self.device)
            meta.workspace, meta.tiles = self.workspace, self.tiles
            meta.wide, meta.merge = len(plan.wide_items) > 0, False
        return meta

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        bs = self.block_size
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_tokens
            table = seq.block_table
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        dev = self.device
        meta = self._prefill_metadata(
            query_lens, context_lens,
            slots=torch.tensor(slots, dtype=torch.int64).to(dev),
            positions=torch.tensor(positions, dtype=torch.int32).to(dev),
            block_tables=tables.to(dev),
        )  # fmt: skip
        last = torch.tensor(np.cumsum(query_lens) - 1, dtype=torch.int64).to(dev)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64).to(dev), meta.positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden[last])

    def _decode(
        self, seqs: list[Sequence], forest: PrefixForest | None, previous: SampledTokens | None
    ) -> torch.Tensor:
        forest = forest or PrefixForest.unshared(len(seqs))
        if self.device.type != "cuda":
            return self._decode_cpu(seqs, forest, previous)
        staging = self.staging
        plan = self._decode_plan(seqs, forest)
        n = len(seqs)
        padded = next((b for b in self.graph_sizes if b >= n), n) if self.graphs else n
        staging.fill(seqs, plan, padded, self.block_size)
        if previous is not None:
            staging.d["input_ids"][:n].copy_(previous.tokens[:n])  # queued after the step that samples them
        key = (padded, len(plan.wide_items) > 0)
        graph = self.graphs.get(key)
        if graph is None:
            return self._decode_eager(n, wide=key[1])
        graph.replay()
        return self.graph_logits[key][:n]

    def _decode_plan(self, seqs: list[Sequence], forest: PrefixForest) -> AttentionPlan:
        """This step's attention plan: the last step's while the batch, its forest and the plan's room hold.

        Planning is host work the GPU waits for at every step; a plan made with room
        serves a batch of long generations for a chunk's worth of steps.
        """
        lengths = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        ids = tuple(s.seq_id for s in seqs)
        cached = self._plan_cache
        # Items name block-table rows (batch indices), not blocks: blocks appended meanwhile change nothing.
        if (
            self.reuse_decode_plans
            and cached is not None
            and cached[1] == ids
            and cached[0] == forest
            and (lengths <= cached[2].capacity).all()
        ):
            return cached[2]
        staging = self.staging
        plan = plan_decode(forest, lengths, self.tiles, self.target_items, staging.max_items, staging.max_rows,
                           self._plan_lanes())  # fmt: skip
        self._plan_cache = (forest, ids, plan)
        return plan

    def _plan_lanes(self) -> int | None:
        """How many programs per KV head the FCA decode kernel runs at once, for plans that balance them.

        Known once that kernel is built (graph capture builds it); until then plans use even chunks.
        """
        if not self.balance_plans:
            return None
        if self._lanes is None and self.kv_cache is not None:
            from arctic_rl_core.zorro.attention.triton_attention import plan_lanes

            self._lanes = plan_lanes(self.config.spec.num_heads, self.kv_cache[0, 0], self.kv_cache[0, 1], self.tiles,
                                     self.config.dtype)  # fmt: skip
        return self._lanes

    def _decode_metadata(self, n: int, wide: bool) -> AttentionMetadata:
        d = self.staging.d
        return AttentionMetadata(
            is_prefill=False, slot_mapping=d["slots"][:n], positions=d["positions"][:n],
            block_tables=self.staging.tables_dev[:n], plan=self.staging.device_plan(n), workspace=self.workspace,
            tiles=self.tiles, wide=wide,
        )  # fmt: skip

    def _decode_eager(self, n: int, wide: bool) -> torch.Tensor:
        meta = self._decode_metadata(n, wide)
        hidden = self.model(self.staging.d["input_ids"][:n], meta.positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden)

    def _decode_cpu(self, seqs: list[Sequence], forest: PrefixForest, previous: SampledTokens | None) -> torch.Tensor:
        bs = self.block_size
        lengths = [s.num_tokens for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        slots = [s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lengths)]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=torch.tensor(slots),
            positions=torch.tensor([n - 1 for n in lengths]),
            block_tables=torch.tensor(
                [s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32
            ),  # fmt: skip
            context_lens=lengths,
            forest=forest,
        )
        input_ids = previous.tokens[: len(seqs)] if previous is not None else torch.tensor([s.last_token for s in seqs])
        hidden = self.model(input_ids, meta.positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden)

    # ---- CUDA graphs ----------------------------------------------------------------------------------------
    @property
    def graph_sizes(self) -> list[int]:
        return graph_batch_sizes(self.config.max_num_seqs)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """One graph per padded batch size (and per FCA launch set), largest first so they share one pool."""
        self.drop_graphs()
        self.staging.reset()
        self.graph_pool = torch.cuda.graph_pool_handle()
        variants = (False, True) if self.config.use_fca else (False,)
        # The captures' cuBLAS workspace must live in the graphs' pool and go with it: cleared before, it is
        # allocated there; cleared after, no later matmul reuses it and nothing outside keeps the pool alive.
        # Otherwise each recapture (after every sleep) may add a 32 MiB workspace that is never freed.
        clear_cublas_workspaces()
        for n in reversed(self.graph_sizes):
            for wide in variants:
                self._decode_eager(n, wide)  # warm-up outside capture: compiles kernels, settles allocations
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.graph_pool):
                    self.graph_logits[(n, wide)] = self._decode_eager(n, wide)
                self.graphs[(n, wide)] = graph
        torch.cuda.synchronize(self.device)
        clear_cublas_workspaces()

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.graph_logits.clear()
        self.graph_pool = None
