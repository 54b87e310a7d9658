"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators, and the
token bitmasks of structured outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.kernels import cpu_ops
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.engine.structured.bitmask import apply_bitmask, new_bitmask

if TYPE_CHECKING:
    from pdserve.engine.structured import GrammarState


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row.

    Exactly ``top_k`` tokens survive the top-k filter, even when logits tie at the cut.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kept = torch.topk(logits, top_k)
        logits = torch.full_like(logits, float("-inf")).scatter(0, kept.indices, kept.values)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass before it is < top_p: the first token always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


class Sampler:
    """Samples one token per row. Seeded requests own a generator, so their draws do not
    depend on what else is in the batch. Constrained requests (``constrain``) sample only among
    the tokens their grammar allows next: one bitmask for the step's rows, applied to the logits
    on their device before anything else reads them (log-probabilities excepted: they stay the
    model's). The sampler only reads a grammar's state; whoever appends the token advances it."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._grammars: dict[str, GrammarState] = {}

    def constrain(self, request_id: str, grammar: GrammarState) -> None:
        """Mask ``request_id``'s rows with ``grammar`` from now until ``forget``."""
        self._grammars[request_id] = grammar

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._grammars.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def skip_draws(self, request_id: str, params: SamplingParams, vocab_size: int, device: torch.device, n: int) -> None:
        """Advance a seeded request's generator past ``n`` draws made elsewhere (a prefill
        worker sampled the first token), so the stream continues as if sampled here.
        A multinomial draw consumes the same generator state whatever the probabilities."""
        gen = None if params.greedy else self._generator(request_id, params, device)
        if gen is None:
            return
        uniform = torch.ones(vocab_size, device=device)
        for _ in range(n):
            torch.multinomial(uniform, 1, generator=gen)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` is ``[n, vocab]``, float32 or the model's dtype; returns one token id per row,
        and its log-probs for the rows whose params ask for them (None for the others). Everything
        but a greedy row's argmax reads the logits widened to float32 (widening keeps their order,
        so a greedy row's token is the same either way)."""
        constrained = [i for i, rid in enumerate(request_ids) if rid in self._grammars]
        if logits.dtype != torch.float32 and (constrained or not all(p.greedy for p in params)):
            logits = logits.float()
        raw = logits
        if constrained:
            if any(p.logprobs is not None for p in params):
                logits = logits.clone()  # the log-probs are read from the unmasked logits
            bitmask = new_bitmask(logits.shape[0], logits.shape[-1], logits.device)
            for i in constrained:
                self._grammars[request_ids[i]].fill(bitmask, i)
            apply_bitmask(logits, bitmask, constrained)
        greedy = _argmax(logits)
        out: list[int] = []
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if p.greedy:
                out.append(int(greedy[i]))
                continue
            row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            gen = self._generator(rid, p, logits.device)
            out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        return out, _logprobs(raw, out, params)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first of tied maxima, a NaN first where a row has one."""
    if cpu_ops.supports(logits):
        return cpu_ops.argmax_rows(logits).tolist()
    # max's indices are argmax's (first of ties, NaN first), and max runs on every thread where argmax does not
    return logits.max(dim=-1).indices.tolist()


def _logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device)).squeeze(1).tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        top = tuple(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())) if n else ()
        result[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return result
