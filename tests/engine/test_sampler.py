"""Sampling against an independent torch reference of the filtered distribution."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import cpu_ops
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target distribution written out directly: softmax(logits/T), keep top-k, keep the
    smallest prefix (by probability) whose mass reaches top_p, renormalise."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, idx in enumerate(order.tolist()):
        if top_k and rank >= top_k:
            break
        keep[idx] = True
        mass += float(probs[idx])
        if mass >= top_p:
            break
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.6), (0.9, 8, 0.8)])
def test_frequencies_match_reference(temperature: float, top_k: int, top_p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    n = 20000
    # No per-request seed: every row draws from the global generator (seeded above).
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = Sampler()
    rows = logits.expand(n, -1).contiguous()
    draws = sampler.sample(rows, [f"r{i}" for i in range(n)], [params] * n)[0]
    freq = torch.bincount(torch.tensor(draws), minlength=12).double() / n
    ref = reference_probs(logits[0], temperature, top_k, top_p)
    assert (freq[ref == 0] == 0).all(), "sampled a token outside the top-k / top-p set"
    assert torch.allclose(freq, ref, atol=0.015)


def test_greedy_and_degenerate_filters_pick_argmax() -> None:
    logits = torch.randn(4, 50)
    want = logits.argmax(-1).tolist()
    s = Sampler()
    assert s.sample(logits, list("abcd"), [SamplingParams()] * 4)[0] == want
    assert s.sample(logits, list("efgh"), [SamplingParams(temperature=1.0, top_k=1, seed=1)] * 4)[0] == want
    assert s.sample(logits, list("ijkl"), [SamplingParams(temperature=1.0, top_p=1e-6, seed=1)] * 4)[0] == want


@pytest.mark.parametrize("kernel", [True, False])
def test_greedy_ties_and_nan_pick_the_first_index_as_argmax_does(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy picks through the one-pass kernel (``cpu_ops.argmax_rows``) or, where it does not run, through
    ``max``'s indices; on a wide batch (several threads) both are argmax's: the first of tied maxima, a
    NaN before any number."""
    if not kernel:
        monkeypatch.setattr(cpu_ops, "supports", lambda x: False)
    torch.manual_seed(0)
    logits = torch.randn(48, 49_152)
    logits[1, [7, 900, 40_000]] = 50.0
    logits[2] = 0.0
    logits[3, [11, 30_000]] = float("nan")
    logits[4, [5, 45_000]] = float("inf")
    want = logits.argmax(-1).tolist()
    assert want[1:5] == [7, 0, 11, 5]
    assert Sampler().sample(logits, [f"r{i}" for i in range(48)], [SamplingParams()] * 48)[0] == want


def test_seed_reproducible_regardless_of_batch() -> None:
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler().sample(logits[1:2], ["x"], [p])[0][0] for _ in range(1)]
    s = Sampler()
    # the same request id + seed in a different batch position draws the same first token
    mixed = s.sample(logits[[0, 1, 2]][[1, 0, 2]], ["x", "y", "z"], [p, SamplingParams(temperature=1.0), p])[0]
    assert mixed[0] == alone[0]
    a = [Sampler().sample(logits[:1], ["q"], [p])[0][0] for _ in range(3)]
    assert len(set(a)) == 1
    # successive draws of one seeded request follow its own stream
    s1, s2 = Sampler(), Sampler()
    seq1 = [s1.sample(logits[:1], ["q"], [p])[0][0] for _ in range(20)]
    seq2 = [s2.sample(logits[:1], ["q"], [p])[0][0] for _ in range(20)]
    assert seq1 == seq2 and len(set(seq1)) > 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_tiny_temperature_is_greedy_not_an_overflow() -> None:
    """logits / 1e-40 would overflow float32 into inf/NaN; below 1e-5 the sampler takes the argmax."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-40, 9e-6, 0.0)]
    assert all(p.greedy for p in params)
    assert Sampler().sample(logits, ["a", "b", "c"], params)[0] == logits.argmax(dim=-1).tolist()
    assert not SamplingParams(temperature=1e-5).greedy


def test_extreme_seeds_are_accepted() -> None:
    logits = torch.zeros(2, 10)
    params = [SamplingParams(temperature=1.0, seed=2**64 - 1), SamplingParams(temperature=1.0, seed=-(2**63))]
    out = Sampler().sample(logits, ["a", "b"], params)[0]
    assert all(0 <= t < 10 for t in out)


def test_top_k_keeps_exactly_k_tokens_on_ties() -> None:
    """Five tokens tie at the top; top_k=2 must sample from two of them only."""
    logits = torch.tensor([[3.0, 3.0, 3.0, 3.0, 3.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    sampler = Sampler()
    seen = {sampler.sample(logits, ["r"], [params])[0][0] for _ in range(200)}
    assert len(seen) == 2 and seen <= {0, 1, 2, 3, 4}


def test_logprobs_are_the_models_raw_distribution() -> None:
    """log_softmax of the logits (before temperature and top-k/top-p), the sampled token's and the
    top alternatives, best first; rows that do not ask get None."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=2, logprobs=0)]
    tokens, logprobs = Sampler().sample(logits, ["a", "b", "c"], params)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[1] is None
    for row in (0, 2):
        lp = logprobs[row]
        assert lp is not None and lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(ref[row, tokens[row]].item(), abs=1e-5)
    top = ref[0].topk(3)
    assert [t for t, _ in logprobs[0].top] == top.indices.tolist()
    assert [v for _, v in logprobs[0].top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert logprobs[2].top == ()
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("",))
    assert SamplingParams(stop="x").stop == ("x",)


def test_bfloat16_logits_sample_as_their_float32_widening() -> None:
    """A step hands the sampler the head's bfloat16 logits: greedy rows take their argmax as read
    (ties and NaN included), and seeded draws, filters and log-probs are those of the same logits
    widened to float32, row for row."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 3000, generator=gen) * 3).bfloat16()
    logits[1, [10, 2000]] = 40.0
    logits[2, [17, 900]] = float("nan")
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(),
              SamplingParams(temperature=0.8, top_k=20, seed=3), SamplingParams(temperature=1.1, top_p=0.7, seed=4),
              SamplingParams(temperature=0.9, seed=5, logprobs=1)]  # fmt: skip
    ids = [f"r{i}" for i in range(6)]
    got = Sampler().sample(logits, ids, params)
    want = Sampler().sample(logits.float(), ids, params)
    assert got[0] == want[0]
    assert got[0][:3] == [int(logits[0].float().argmax()), 10, 17]
    assert got[1] == want[1] and got[1][0] is not None and got[1][5] is not None
    greedy_only = Sampler().sample(logits[:3], ids[:3], [SamplingParams()] * 3)[0]
    assert greedy_only == logits[:3].float().argmax(dim=-1).tolist()
