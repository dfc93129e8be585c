"""Sampler: greedy, filters, seeded batch independence, min_tokens ban, logprobs."""

import pytest
import torch
from dpserve_shared.schema import SamplingParams

from dpserve_engine.sampler import SamplingTensors, apply_filters, sample

pytestmark = pytest.mark.timeout(30)
V = 50


def tensors(params: list[SamplingParams], generators=(), banned=None, disallowed=None):
    greedy = [p.temperature <= 1e-5 for p in params]
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    requested = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingTensors(
        temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)]),  # always given
        is_greedy=torch.tensor(greedy),
        top_k=torch.tensor(ks) if any(k < V for k in ks) else None,
        top_p=torch.tensor([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        min_p=torch.tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        disallowed=disallowed,
        banned=banned,
        generators=list(generators),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        num_logprobs=max(requested) if requested else None,
    )


def logits(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits(4)
    out = sample(x, tensors([SamplingParams(temperature=0)] * 4))
    assert out.token_ids.tolist() == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_argmax():
    x = logits(3)
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=0.999)):
        out = sample(x.clone(), tensors([p] * 3))
        assert out.token_ids.tolist() == x.argmax(-1).tolist()


def test_top_k_keeps_exactly_k():
    x = logits(2)
    filtered = apply_filters(x.clone(), tensors([SamplingParams(top_k=5), SamplingParams(top_k=0)]))
    assert torch.isfinite(filtered[0]).sum() == 5 and torch.isfinite(filtered[1]).sum() == V


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    filtered = apply_filters(x.clone(), tensors([SamplingParams(top_p=0.7)]))
    assert torch.isfinite(filtered[0]).sum() == 2


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(6)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(rows):
        gens = [(i, torch.Generator().manual_seed(42)) for i in range(len(rows))] if rows else []
        return sample(x[rows], tensors([seeded] * len(rows), gens)).token_ids.tolist()

    alone = [run([i])[0] for i in range(6)]
    together = run(list(range(6)))
    assert alone == together
    unseeded = sample(x, tensors([SamplingParams(temperature=1.0)] * 6)).token_ids
    assert unseeded.shape == (6,)


@pytest.mark.parametrize("vocab", [V, 1024])  # one-level and two-level (256-token chunks) inverse CDF
def test_sampling_follows_the_distribution(vocab):
    probs = torch.zeros(vocab)
    probs[[0, vocab // 2 + 1, vocab - 1]] = torch.tensor([0.6, 0.3, 0.1])
    x = torch.log(probs).expand(4000, vocab).clone()
    params = tensors([SamplingParams(temperature=1.0)] * 4000)
    counts = torch.bincount(sample(x, params).token_ids, minlength=vocab)
    assert counts.sum() == 4000 and counts[probs == 0].sum() == 0
    assert abs(counts[0] / 4000 - 0.6) < 0.04 and abs(counts[vocab - 1] / 4000 - 0.1) < 0.03


def test_mixed_greedy_and_random_rows():
    x = logits(4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(top_k=3)]
    out = sample(x.clone(), tensors(params)).token_ids
    assert out[0] == x[0].argmax() and out[2] == x[2].argmax()
    assert out[3] in x[3].topk(3).indices


def test_banned_ids_are_never_sampled():
    x = torch.zeros(1, V)
    x[0, 7] = 100.0
    banned = (torch.tensor([0]), torch.tensor([7]))
    out = sample(x, tensors([SamplingParams(temperature=0)], banned=banned))
    assert out.token_ids.item() != 7


def test_logprobs_from_raw_distribution():
    x = logits(3)
    out = sample(x.clone(), tensors([SamplingParams(temperature=0, logprobs=4)] * 3))
    raw = x.log_softmax(-1)
    assert out.top_ids.shape == (3, 4) and out.top_logprobs.shape == (3, 4)
    assert torch.allclose(out.logprobs, raw.max(-1).values) and out.ranks.tolist() == [1, 1, 1]
    assert out.top_ids[:, 0].tolist() == out.token_ids.tolist()


def test_a_grammar_mask_limits_greedy_and_filtered_rows_only_and_logprobs_stay_raw():
    """Row 0 greedy, row 1 top-k 3, both masked to the tokens 5 and 9; row 2 unmasked (its argmax stays). Logprobs
    are the raw distribution's: the masked argmax ranks below the raw best."""
    x = logits(3)
    disallowed = torch.ones(3, V, dtype=torch.bool)
    disallowed[:2, [5, 9]] = False
    disallowed[2] = False
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(top_k=3), SamplingParams(temperature=0)]
    out = sample(x.clone(), tensors(params, disallowed=disallowed))
    assert out.token_ids[0] == (5 if x[0, 5] > x[0, 9] else 9) and out.token_ids[1] in (5, 9)
    assert out.token_ids[2] == x[2].argmax()
    raw = x[0].log_softmax(-1)
    chosen = out.token_ids[0]
    assert torch.isclose(out.logprobs[0], raw[chosen]) and out.ranks[0] == (raw > raw[chosen]).sum() + 1
