"""Turns a scheduled batch into model inputs, runs the model over the paged KV cache and samples.

Everything per step is built from Python lists in one pass over the sequences (never over tokens) and turned
into tensors once; the model then sees one flat token batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import logging
import math
import mmap
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch
from dpserve_shared.schema import TokenLogprob
from torch import Tensor

from dpserve_engine.grammar import disallowed_tokens
from dpserve_engine.progress import INTERVAL_S, Ticker
from dpserve_engine.model import AttentionMetadata, DecodeInputs, PrefillChunk, Transformer
from dpserve_engine.sampler import SamplerOutput, SamplingTensors, sample
from dpserve_engine.scheduler import ScheduledBatch
from dpserve_engine.sequence import Sequence

if TYPE_CHECKING:
    from dpserve_engine.compiled import CompiledDecode

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = INTERVAL_S  # a progress line this often while the decode step is being prepared


@contextlib.contextmanager
def compile_lock(cache_dir: str):
    """One compile of the decode step at a time per cache dir (per node, by default): ranks that start together
    would otherwise compile the same graphs side by side on the same cores; the ones that wait find them cached."""
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, "compile.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another rank's compile of the decode step (%s)", cache_dir)
            started = time.monotonic()
            fcntl.flock(f, fcntl.LOCK_EX)
            logger.info("waited %.1f s for another rank's compile", time.monotonic() - started)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclasses.dataclass
class StepResult:
    """Per scheduled sequence (same order as the batch): the new token (None while mid-prefill), its logprob
    entry, and the prompt logprobs computed this step."""

    token_ids: list[int | None]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[list[TokenLogprob]]


def zeroed_buffers(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """`count` zero tensors of `shape` (the KV cache). On CPU they are views of one anonymous private mapping,
    which the kernel fills with zero pages as they are first touched: a rank does not write its whole cache at
    start-up (torch.zeros writes every byte: 1 GiB by default, 0.2 s where the memory was used before, ~10 s on a
    VM that backs fresh memory only when it is first written); `populate_in_background` faults them in later."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    stride = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # every buffer starts on a page
    area = mmap.mmap(-1, max(1, stride * count), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` for as long as a view of it lives
    return [flat[i * stride: i * stride + nbytes].view(dtype).view(shape) for i in range(count)]


MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
POPULATE_CHUNK = 1 << 20  # bytes a call: the kernel holds the address space's lock for about one call


def populate_in_background(buffers: list[Tensor], after: threading.Thread | None = None) -> threading.Thread | None:
    """Fault in every page of `buffers` (CPU tensors, ascending and close together, as zeroed_buffers makes them)
    from a lowest-priority thread, once `after` (the decode step's preparation) has ended: madvise
    MADV_POPULATE_WRITE allocates the pages a first write would, their contents untouched, so it is safe beside
    the steps that write them. A page first touched by a step costs that step its zeroing: ~0.7 MiB a KV block,
    and on a VM that backs fresh memory at ~100 MB/s, 10 % of a rank's time at c=32 with distinct prompts until
    every block was used once. Nothing happens where the call is unsupported (not Linux, a kernel before 5.14)."""
    if not buffers or buffers[0].device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    start = buffers[0].data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    size = max(b.data_ptr() + b.numel() * b.element_size() for b in buffers) - start

    def run() -> None:
        if after is not None:
            after.join()  # the load of the decode step maps files: the populating would slow it down
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call releases the GIL
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError) as e:
            logger.debug("KV cache pages not populated: %s", e)
            return
        started = time.monotonic()
        for offset in range(0, size, POPULATE_CHUNK):
            if madvise(start + offset, min(POPULATE_CHUNK, size - offset), MADV_POPULATE_WRITE) != 0:
                logger.debug("KV cache pages not populated: madvise: %s", os.strerror(ctypes.get_errno()))
                return
        logger.info("KV cache pages populated in %.1f s (background, lowest priority)", time.monotonic() - started)

    # the thread holds `buffers`, and so the mapping, until it is done
    thread = threading.Thread(target=run, name="kv-populate", daemon=True)
    thread.start()
    return thread


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, eos_token_ids: list[int]):
        self.model = model
        self.compiled: CompiledDecode | None = None  # set by compile_decode() once the graphs are ready
        self.compile_thread: threading.Thread | None = None  # compile_decode(background=True)
        self.populate_thread: threading.Thread | None = None  # populate_kv_cache()
        self.device = model.rope_cos.device
        self.block_size = block_size
        self.num_blocks = num_blocks + 1  # in the cache: the scheduler's blocks, then one scratch block
        self.scratch_block = num_blocks  # never allocated: padding rows of the compiled decode write here
        self.eos_token_ids = list(eos_token_ids)
        args, kv_dtype = model.args, model.prec.kv
        # Per layer K and V: [Hkv, num_blocks * block_size, hd], indexed by flat slot (block * block_size + offset)
        shape = (args.n_kv_heads, self.num_blocks * block_size, args.head_dim)
        buffers = zeroed_buffers(2 * args.n_layers, shape, kv_dtype, self.device)
        self.kv_caches = list(zip(buffers[0::2], buffers[1::2]))
        self.block_offsets = torch.arange(block_size, device=self.device)
        logger.info("KV cache: %d blocks x %d tokens, %s", num_blocks, block_size, kv_dtype)

    def populate_kv_cache(self) -> None:
        """Fault the KV cache's pages in from a background thread (`populate_thread`), after the decode step's
        preparation if that runs in the background too (`populate_in_background`)."""
        self.populate_thread = populate_in_background([t for kv in self.kv_caches for t in kv], after=self.compile_thread)

    def compile_decode(self, cache_dir: str, background: bool = False) -> None:
        """Compile the decode step (compiled.py), or load it from inductor's cache: now, or in a background thread
        while steps run eagerly (`background`: a rank serves at once and switches over when it is ready: about a
        second from a saved step (precompiled.py), tens of seconds when it must be traced, minutes when compiled)."""
        from dpserve_engine.compiled import CompiledDecode

        args = self.model.args
        if args.is_moe:
            logger.info("MoE model (%d experts, top-%d): the decode step runs eagerly (the compiled step covers dense "
                        "models only: per-expert token counts are data-dependent)", args.num_experts,
                        args.num_experts_per_tok)  # fmt: skip
            return
        try:
            compiled = CompiledDecode(self.model, self.kv_caches, cache_dir)  # stacks the weights; compiles nothing
        except Exception as e:  # noqa: BLE001 - e.g. the attention op cannot be built: serve eagerly
            self._compile_failed(e)
            return
        if not background:
            self._warm_up(compiled, cache_dir)
            return
        # The tracing thread holds the GIL for up to the switch interval each time a step's op lets it go: at the
        # default 5 ms an eager step of a few hundred ops then takes seconds. A short interval while it runs.
        self._switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval_s, 0.00002))
        self.compile_thread = threading.Thread(
            target=self._warm_up, args=(compiled, cache_dir), name="compile-decode", daemon=True
        )
        self.compile_thread.start()

    @torch.inference_mode()  # the inputs too: the guards compare their dispatch keys with run()'s
    def _warm_up(self, compiled: CompiledDecode, cache_dir: str) -> None:
        ticker = Ticker(logger, "decode step", lambda: compiled.phase, " (decode runs eagerly meanwhile)",
                        PROGRESS_INTERVAL_S)  # fmt: skip
        try:
            compiled.phase = "waiting for another rank's compile (one at a time per cache dir)"
            with ticker, compile_lock(cache_dir):
                compiled.warm_up(lambda rows, blocks: self.prepare_decode_only([], rows, blocks))  # scratch rows only
        except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler: serve eagerly rather than not at all
            self._compile_failed(e)
            return
        finally:
            if self.compile_thread is not None:
                sys.setswitchinterval(self._switch_interval_s)
        self.compiled = compiled  # one assignment: the next step takes the compiled path

    @staticmethod
    def _compile_failed(e: Exception) -> None:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        logger.warning("compiling the decode step failed, running eager PyTorch: %s: %s", type(e).__name__,
                       " ".join(lines[:2]))  # e.g. "backend='inductor' raised:" and its cause

    @staticmethod
    def kv_bytes_per_block(model_args, block_size: int, kv_dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        return 2 * model_args.n_layers * block_size * model_args.n_kv_heads * model_args.head_dim * elem

    # -- inputs ----------------------------------------------------------------------------------------------

    def _slots(self, block_table: Tensor, num_tokens: int) -> Tensor:
        """Flat cache slots of positions 0..num_tokens-1 of a sequence."""
        num_blocks = -(-num_tokens // self.block_size)
        return (block_table[:num_blocks].unsqueeze(-1) * self.block_size + self.block_offsets).view(-1)[:num_tokens]

    def prepare(self, batch: ScheduledBatch) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """-> tokens [T], positions [T], attention metadata; decodes first, then prefill chunks."""
        D = batch.num_decodes
        tokens, positions, slots, decode_index, decode_bias = self._prepare_decodes(batch.seqs[:D])
        prefills, prefill_positions, prefill_slots = self._prepare_prefills(batch, D, tokens)
        dev = self.device
        positions_t = torch.cat([torch.tensor(positions, dtype=torch.long, device=dev), *prefill_positions])
        slots_t = torch.cat([torch.tensor(slots, dtype=torch.long, device=dev), *prefill_slots])
        meta = AttentionMetadata(slots_t, D, self.block_size, decode_index, decode_bias, prefills)
        return torch.tensor(tokens, dtype=torch.long, device=dev), positions_t, meta

    def _prepare_decodes(self, decodes: list[Sequence]):
        """One token per sequence; block tables padded to the longest, and the bias that masks the padding."""
        tokens, positions, slots, tables = self._decode_lists(decodes)
        if not decodes:
            return tokens, positions, slots, None, None
        dev, bs = self.device, self.block_size
        tables_t = torch.tensor(tables, device=dev)
        heads = torch.arange(self.model.args.n_kv_heads, device=dev).view(-1, 1, 1) * self.num_blocks
        block_index = (heads + tables_t).view(-1)  # [Hkv * D * nb] rows of the [Hkv * num_blocks, bs * hd] view
        context_lens = torch.tensor(positions, device=dev).unsqueeze(1) + 1  # [D, 1]
        is_pad = torch.arange(len(tables[0]) * bs, device=dev) >= context_lens  # [D, L]
        decode_bias = torch.zeros(is_pad.shape, device=dev).masked_fill_(is_pad, float("-inf"))
        return tokens, positions, slots, block_index, decode_bias.view(1, len(decodes), 1, -1)

    def _decode_lists(self, decodes: list[Sequence], min_blocks: int = 1):
        """Per decode: its token, position, cache slot and block table (padded with block 0 to the longest). The
        last token of a fully cached prompt writes its K/V to the scratch block: the shared block it lies in holds
        it (other sequences read that block), and attention reads it there."""
        bs = self.block_size
        tokens = [s.token_ids[s.num_computed_tokens] for s in decodes]
        positions = [s.num_computed_tokens for s in decodes]
        scratch = self.scratch_block * bs  # a position whose K/V a shared block holds already is not rewritten
        slots = [s.block_table[p // bs] * bs + p % bs if p >= s.num_reused_tokens else scratch
                 for s, p in zip(decodes, positions)]  # fmt: skip
        width = max([min_blocks] + [len(s.block_table) for s in decodes])
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
        return tokens, positions, slots, tables

    def prepare_decode_only(self, decodes: list[Sequence], min_rows: int, min_blocks: int) -> DecodeInputs:
        """Decodes as DecodeInputs (the compiled path), padded to `min_rows` rows that write to the scratch block
        and attend to position 0 of it; the matmuls skip the padding rows (num_rows)."""
        tokens, positions, slots, tables = self._decode_lists(decodes, min_blocks)
        num_rows = max(len(decodes), 1)  # padding only: one row computed (they are all alike)
        width = len(tables[0]) if tables else min_blocks
        for _ in range(min_rows - len(decodes)):
            tokens.append(0)
            positions.append(0)
            slots.append(self.scratch_block * self.block_size)
            tables.append([self.scratch_block] * width)
        dev = self.device
        return DecodeInputs(
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(tables, device=dev),
            self.block_size,
            torch.tensor(num_rows),  # on the CPU: read with .item() in the graph
        )

    def _prepare_prefills(self, batch: ScheduledBatch, first_row: int, tokens: list[int]):
        """Per chunk: its rows, the slots of its whole context (prefix + chunk) and its causal mask."""
        dev, row = self.device, first_row
        prefills, positions, slots = [], [], []
        for seq, n in zip(batch.seqs[first_row:], batch.num_tokens[first_row:]):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            tokens.extend(seq.token_ids[start:end])
            context_slots = self._slots(torch.tensor(seq.block_table, device=dev), end)  # [C]
            query_pos = torch.arange(start, end, device=dev)
            mask = torch.arange(end, device=dev).unsqueeze(0) <= query_pos.unsqueeze(1)  # [n, C]
            prefills.append(PrefillChunk(row, row + n, context_slots, mask))
            positions.append(query_pos)
            slots.append(context_slots[start:end])
            row += n
        return prefills, positions, slots

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        dev, vocab = self.device, self.model.args.vocab_size
        params = [s.params for s in seqs]
        is_greedy = [p.temperature <= 1e-5 for p in params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, is_greedy)]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        banned_rows, banned_ids = [], []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                ids = seq.params.stop_token_ids + ([] if seq.params.ignore_eos else self.eos_token_ids)
                banned_rows += [row] * len(ids)
                banned_ids += ids
        requested = [p.logprobs for p in params if p.logprobs is not None]
        constrained = [(row, s.matcher) for row, s in enumerate(seqs) if s.matcher is not None]
        disallowed = (disallowed_tokens(constrained, len(seqs), vocab, torch.get_num_threads()) if constrained
                      else None)  # structured outputs
        return SamplingTensors(
            temperature=torch.tensor(temperatures, device=dev) if any(x != 1.0 for x in temperatures) else None,
            is_greedy=torch.tensor(is_greedy, device=dev),
            top_k=torch.tensor(top_ks, device=dev) if any(k < vocab for k in top_ks) else None,
            top_p=torch.tensor([p.top_p for p in params], device=dev) if any(p.top_p < 1 for p in params) else None,
            min_p=torch.tensor([p.min_p for p in params], device=dev) if any(p.min_p > 0 for p in params) else None,
            disallowed=torch.from_numpy(disallowed).to(dev) if disallowed is not None else None,
            banned=(torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev)) if banned_rows else None,
            generators=[(r, s.generator) for r, (s, g) in enumerate(zip(seqs, is_greedy)) if s.generator and not g],
            all_greedy=all(is_greedy),
            any_greedy=any(is_greedy),
            num_logprobs=max(requested) if requested else None,
        )

    # -- step ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        hidden = self._compiled_forward(batch)
        if hidden is None:
            tokens, positions, meta = self.prepare(batch)
            hidden = self.model(tokens, positions, meta, self.kv_caches)  # [T, dim]
        sample_rows, sample_seqs, prompt_rows = [], [], []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed_tokens + n == len(seq):
                sample_rows.append(row + n - 1)
                sample_seqs.append(seq)
            if seq.wants_prompt_logprobs:
                prompt_rows.append(self._prompt_logprob_rows(seq, n, row))
            row += n
        token_ids, logprobs = self._sample(hidden, sample_rows, sample_seqs)
        prompt_logprobs = self._prompt_logprobs(hidden, batch, prompt_rows)
        by_seq = {id(s): i for i, s in enumerate(sample_seqs)}
        return StepResult(
            [token_ids[by_seq[id(s)]] if id(s) in by_seq else None for s in batch.seqs],
            [logprobs[by_seq[id(s)]] if id(s) in by_seq else None for s in batch.seqs],
            prompt_logprobs,
        )

    def _compiled_forward(self, batch: ScheduledBatch) -> Tensor | None:
        """Hidden states with every decode row from the compiled decode step, and prefill rows (if any) from an
        eager forward of their own: each kind of row always takes the same path, so a request's tokens do not
        depend on what it is batched with. None without a compiled step or decodes (the eager forward then)."""
        D = batch.num_decodes
        if self.compiled is None or D == 0:
            return None
        compiled = self.compiled
        hidden = compiled(self.prepare_decode_only(batch.seqs[:D], compiled.min_rows, compiled.min_blocks))
        if hidden is None:
            return None
        if D == len(batch.seqs):
            return hidden[:D]
        prefills = ScheduledBatch(batch.seqs[D:], batch.num_tokens[D:], 0)
        tokens, positions, meta = self.prepare(prefills)
        return torch.cat([hidden[:D], self.model(tokens, positions, meta, self.kv_caches)])

    def _sample(
        self, hidden: Tensor, rows: list[int], seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        if not rows:
            return [], []
        logits = self.model.compute_logits(hidden[rows] if len(rows) < hidden.shape[0] else hidden)  # [N, V]
        out = sample(logits, self.sampling_tensors(seqs))
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return token_ids, [None] * len(rows)
        entries = _token_logprobs(out, [seq.params.logprobs or 0 for seq in seqs])
        return token_ids, [e if seq.params.logprobs is not None else None for e, seq in zip(entries, seqs)]

    def _prompt_logprob_rows(self, seq: Sequence, n: int, row: int) -> range:
        """Rows whose logits score the next prompt token and that have not been scored before (recompute)."""
        start = seq.num_computed_tokens
        first = max(start, len(seq.prompt_logprobs) - 1)
        last = min(start + n, seq.num_prompt_tokens - 1)
        return range(row + first - start, row + max(first, last) - start)

    def _prompt_logprobs(
        self, hidden: Tensor, batch: ScheduledBatch, prompt_rows: list[range]
    ) -> list[list[TokenLogprob]]:
        result: list[list[TokenLogprob]] = [[] for _ in batch.seqs]
        wanting = [(i, s) for i, s in enumerate(batch.seqs) if s.wants_prompt_logprobs]
        for (i, seq), rows in zip(wanting, prompt_rows):
            if not rows:
                continue
            logprobs = self.model.compute_logits(hidden[rows.start : rows.stop]).log_softmax(dim=-1)  # [n, V]
            first_pos = len(seq.prompt_logprobs) - 1  # the prompt position rows.start scores the next token of
            targets = torch.tensor(seq.token_ids[first_pos + 1 : first_pos + 1 + len(rows)], device=self.device)
            chosen = logprobs.gather(1, targets.unsqueeze(1))
            k = seq.params.prompt_logprobs
            top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            out = SamplerOutput(targets, chosen.squeeze(1), (logprobs > chosen).sum(-1) + 1, top_ids, top_lp)
            result[i] = _token_logprobs(out, [k or 0] * len(rows))
        return result


def _token_logprobs(out: SamplerOutput, ks: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row with its top ks[row] alternatives; tensors turned into lists once."""
    token_ids, logprobs, ranks = out.token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_logprobs = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    return [
        TokenLogprob(token_ids[i], logprobs[i], ranks[i], top_ids[i][:k] if k else [], top_logprobs[i][:k] if k else [])
        for i, k in enumerate(ks)
    ]
