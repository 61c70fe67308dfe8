"""Rollout correction (rollout_correction.py, and the diagnostics every run logs, losses.offpolicy_metrics) against
independent float64 re-implementations of veRL 0.9.1's formulas (verl/trainer/ppo/rollout_corr_helper.py),
written here with Python loops over lists, never calling the code under test."""

import math

import pytest
import torch

from losses import offpolicy_metrics
from rollout_correction import rollout_correction_metrics, rollout_is_weights, rollout_rejection_mask

F64 = torch.float64
CLIP = 20.0


def clip(v: float) -> float:
    return min(max(v, -CLIP), CLIP)


def batch(seed: int, dtype=F64):
    """old, rollout log-probs and mask [6, 7]: ragged rows, an empty row, a full row, |delta| > 20 (token and
    row sum), finite garbage at padding."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 7, generator=g, dtype=F64) * 2  # [6, 7]
    roll = old + torch.randn(6, 7, generator=g, dtype=F64) * 0.3  # [6, 7]
    lengths = torch.tensor([3, 0, 7, 1, 5, 4])
    mask = (torch.arange(7)[None] < lengths[:, None]).to(F64)  # [6, 7]
    roll[2, 1] = old[2, 1] - 25.0  # token delta +25
    roll[4, 0] = old[4, 0] + 23.0  # token delta -23
    roll[5, :4] = old[5, :4] - 6.0  # row sum +24
    old = torch.where(mask.bool(), old, 30.0)  # padding garbage
    return old.to(dtype), roll.to(dtype), mask.to(dtype)


def rows(old, roll, mask):
    """[(deltas of the valid tokens, valid flags, all deltas)] per row, in float64 Python floats."""
    d = (old.double() - roll.double()).tolist()
    return [(dr, [bool(k) for k in mr]) for dr, mr in zip(d, mask.tolist(), strict=True)]


# ---------------------------------------------------------------- reference implementations (float64, loops)
def ref_is_weights(old, roll, mask, level, threshold, batch_normalize=False):
    if isinstance(threshold, str) and "_" in threshold:
        lo, hi = (float(p) for p in threshold.split("_", 1))
    else:
        lo, hi = None, float(threshold)
    out = []
    for d, valid in rows(old, roll, mask):
        seq = sum(x for x, k in zip(d, valid, strict=True) if k)
        row = []
        for x, k in zip(d, valid, strict=True):
            w = math.exp(clip(seq if level == "sequence" else x)) if k else 0.0
            row.append(min(w, hi) if lo is None else (w if lo <= w <= hi else 0.0))
        out.append(row)
    if batch_normalize:
        flags = [valid for _, valid in rows(old, roll, mask)]
        if level == "token":
            kept = [w for row, valid in zip(out, flags, strict=True) for w, k in zip(row, valid, strict=True) if k]
            mean = sum(kept) / (len(kept) + 1e-8)
        else:
            per_row = [
                sum(w for w, k in zip(row, valid, strict=True) if k) / (sum(valid) + 1e-8)
                for row, valid in zip(out, flags, strict=True)
                if any(valid)
            ]
            mean = sum(per_row) / max(len(per_row), 1e-8)
        if mean > 1e-8:
            out = [[w / mean for w in row] for row in out]
    return torch.tensor(out, dtype=F64)


def ref_bounds(option, spec):
    if option.endswith("k1"):
        lo, hi = spec.split("_") if "_" in spec else (1.0 / float(spec), spec)
        return float(lo), float(hi)
    return None, float(spec)


def ref_rejection(old, roll, mask, modes, thresholds):
    options = []
    for o in modes.split(","):
        if o.strip() and o.strip() not in options:
            options.append(o.strip())
    specs = [s.strip() for s in str(thresholds).split(",")]
    specs = specs * len(options) if len(specs) == 1 else specs
    out = []
    for d, valid in rows(old, roll, mask):
        keep = [1.0 if k else 0.0 for k in valid]
        for option, spec in zip(options, specs, strict=True):
            lo, hi = ref_bounds(option, spec)
            stats = []
            for x in (clip(v) for v in d):
                stats.append({"1": -x, "2": x * x / 2, "3": math.exp(x) - 1 - x}[option[-1]])
            own = [s for s, k in zip(stats, valid, strict=True) if k]
            if option.startswith("seq_sum"):
                stats = [sum(own)] * len(d)
            elif option.startswith("seq_mean"):
                stats = [sum(own) / (len(own) + 1e-8)] * len(d)
            elif option.startswith("seq_max"):
                stats = [max(own) if own else 0.0] * len(d)
            for t, s in enumerate(stats):
                ok = math.log(lo) <= s <= math.log(hi) if lo is not None else s <= hi
                keep[t] = keep[t] if ok else 0.0
        out.append(keep)
    return torch.tensor(out, dtype=F64)


def mean(xs):
    return sum(xs) / len(xs)


def ref_offpolicy(old, roll, mask):
    o_rows, r_rows, tokens = [], [], []
    for oi, ri, mi in zip(old.tolist(), roll.tolist(), mask.tolist(), strict=True):
        n = sum(mi)
        o_rows.append(sum(a for a, k in zip(oi, mi, strict=True) if k) / (n + 1e-8))
        r_rows.append(sum(b for b, k in zip(ri, mi, strict=True) if k) / (n + 1e-8))
        tokens += [(a, b) for a, b, k in zip(oi, ri, mi, strict=True) if k]
    n_tok = len(tokens) + 1e-8
    diff = [r - o for o, r in zip(o_rows, r_rows, strict=True)]
    seq = [clip(sum(x for x, k in zip(d, valid, strict=True) if k)) for d, valid in rows(old, roll, mask)]
    return {
        "training_ppl": mean([math.exp(-o) for o in o_rows]),
        "training_log_ppl": -mean(o_rows),
        "kl": sum(b - a for a, b in tokens) / n_tok,
        "k3_kl": sum(math.exp(a - b) - (a - b) - 1 for a, b in tokens) / n_tok,
        "rollout_ppl": mean([math.exp(-r) for r in r_rows]),
        "rollout_log_ppl": -mean(r_rows),
        "log_ppl_diff": mean(diff),
        "log_ppl_abs_diff": mean([abs(x) for x in diff]),
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": mean([math.exp(x) for x in diff]),
        "chi2_token": sum(math.exp(2 * clip(a - b)) for a, b in tokens) / n_tok - 1,
        "chi2_seq": mean([math.exp(2 * s) for s in seq]) - 1,
    }


def ref_metrics(old, roll, mask, level, threshold, new_mask):
    w = ref_is_weights(old, roll, mask, level, threshold).tolist()
    lo, hi = (
        (float(p) for p in threshold.split("_"))
        if isinstance(threshold, str) and "_" in threshold
        else (None, float(threshold))
    )
    lo = 1 / hi if lo is None else lo
    data = rows(old, roll, mask)
    valid_w = [x for wr, (_, valid) in zip(w, data, strict=True) for x, k in zip(wr, valid, strict=True) if k]
    n = len(valid_w) + 1e-8
    out = {"rollout_is_mean": sum(valid_w) / n}
    if level == "token":
        raw = [math.exp(clip(x)) for d, valid in data for x, k in zip(d, valid, strict=True) if k]
        out.update(
            rollout_is_max=max(valid_w),
            rollout_is_min=min(valid_w),
            rollout_is_ratio_fraction_high=sum(r > hi for r in raw) / n,
            rollout_is_ratio_fraction_low=sum(r < lo for r in raw) / n,
        )
    else:
        sums = [sum(x for x, k in zip(d, valid, strict=True) if k) for d, valid in data]  # unclamped, every row
        out.update(
            rollout_is_max=math.exp(min(max(sums), CLIP)),
            rollout_is_min=math.exp(min(sums)),
            rollout_is_ratio_fraction_high=mean([s > math.log(hi) for s in sums]),
            rollout_is_ratio_fraction_low=mean([s < math.log(lo) for s in sums]),
        )
    c = [min(max(x, 0.0), hi) for x in valid_w]
    c_mean = sum(c) / n
    out["rollout_is_eff_sample_size"] = 1 / (sum((x / (c_mean + 1e-8)) ** 2 for x in c) / n)
    rejected = [
        [k and not kept for k, kept in zip(valid, nm, strict=True)]
        for (_, valid), nm in zip(data, new_mask.tolist(), strict=True)
    ]
    out["rollout_rs_masked_fraction"] = sum(map(sum, rejected)) / n
    out["rollout_rs_seq_masked_fraction"] = mean([any(r) for r in rejected])
    return out


# ---------------------------------------------------------------- rollout_is_weights
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "3", 1e12, "0.5_5.0", "1e-12_1e12", "0.2_1.5"])
@pytest.mark.parametrize("batch_normalize", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_is_weights_match_reference(level, threshold, batch_normalize, seed):
    old, roll, mask = batch(seed)
    got = rollout_is_weights(old, roll, mask, level, threshold, batch_normalize)
    torch.testing.assert_close(
        got, ref_is_weights(old, roll, mask, level, threshold, batch_normalize), rtol=1e-10, atol=0
    )
    assert not got.requires_grad and (got[mask == 0] == 0).all()


def test_is_weights_clamp_at_20_is_visible():
    old, roll, mask = batch(0)
    tok = rollout_is_weights(old, roll, mask, "token", 1e12)
    assert tok[2, 1].item() == pytest.approx(math.exp(20)) and tok[4, 0].item() == pytest.approx(math.exp(-20))
    seq = rollout_is_weights(old, roll, mask, "sequence", 1e12)
    assert seq[5, :4].tolist() == pytest.approx([math.exp(20)] * 4)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_bounds_are_inclusive(level):
    """Rows of one real token (+ padding): weights exactly at lo and hi are kept, just outside are zeroed."""
    d = torch.tensor([-0.7, -0.3, 0.2, 0.9, 0.5], dtype=F64)
    old = torch.zeros(5, 3, dtype=F64)
    roll = torch.zeros(5, 3, dtype=F64)
    roll[:, 0] = -d
    mask = torch.tensor([[1.0, 0.0, 0.0]] * 5, dtype=F64)
    w = torch.exp(d)  # what veRL computes for these rows
    lo, hi = w[1].item(), w[2].item()
    got = rollout_is_weights(old, roll, mask, level, f"{lo!r}_{hi!r}")[:, 0]
    assert got.tolist() == [0.0, lo, hi, 0.0, 0.0]


def test_is_batch_normalize_skipped_when_every_weight_is_rejected():
    old, roll, mask = batch(0)
    for level in ("token", "sequence"):
        got = rollout_is_weights(old, roll, mask, level, "1e9_1e10", batch_normalize=True)
        assert got.abs().sum().item() == 0.0 and not got.isnan().any()
        ess = rollout_correction_metrics(old, roll, mask, level, "1e9_1e10")["rollout_is_eff_sample_size"]
        assert ess == math.inf  # veRL itself raises ZeroDivisionError here


def test_is_batch_normalize_gives_mean_one():
    old, roll, mask = batch(3)
    tok = rollout_is_weights(old, roll, mask, "token", 2.0, batch_normalize=True)
    assert ((tok * mask).sum() / mask.sum()).item() == pytest.approx(1.0)
    seq = rollout_is_weights(old, roll, mask, "sequence", 2.0, batch_normalize=True)
    assert seq[[0, 2, 3, 4, 5], 0].mean().item() == pytest.approx(1.0)  # the empty row 1 does not count


def test_is_weights_float32_and_integer_mask():
    old, roll, mask = batch(1, torch.float32)
    got = rollout_is_weights(old, roll, mask.long(), "token", 2.0)
    torch.testing.assert_close(got.double(), ref_is_weights(old, roll, mask, "token", 2.0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("threshold", ["abc", "", "0_1", "2_1", "-1", 0, -2.0, True, None, "1_x", [2.0]])
def test_is_threshold_errors_name_the_argument(threshold):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"rollout_is_weights: threshold=.*lo_hi"):
        rollout_is_weights(x, x, torch.ones(1, 2), "token", threshold)


def test_is_level_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="level='seq'; accepted: token, sequence"):
        rollout_is_weights(x, x, torch.ones(1, 2), "seq")


# ---------------------------------------------------------------- rollout_rejection_mask
SINGLE = {  # option -> threshold giving a non-trivial mask on batch(seed)
    "token_k1": "0.75_1.25",
    "token_k2": "0.04",
    "token_k3": "0.04",
    "seq_sum_k1": "0.5_2.0",
    "seq_sum_k2": "0.15",
    "seq_sum_k3": "0.15",
    "seq_mean_k1": "0.8_1.25",
    "seq_mean_k2": "0.05",
    "seq_mean_k3": "0.05",
    "seq_max_k2": "0.1",
    "seq_max_k3": "0.1",
}


@pytest.mark.parametrize("option", sorted(SINGLE))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_rejection_option_alone(option, seed):
    old, roll, mask = batch(seed)
    want = ref_rejection(old, roll, mask, option, SINGLE[option])
    assert 0 < want.sum() < mask.sum()  # the case rejects something and keeps something
    got = rollout_rejection_mask(old, roll, mask, option, SINGLE[option])
    assert got.dtype == mask.dtype and torch.equal(got, want)


@pytest.mark.parametrize("option", sorted(SINGLE))
def test_rejection_number_thresholds(option):
    old, roll, mask = batch(4)
    spec = 1.3 if option.endswith("k1") else 0.07  # k1: a number hi means lo = 1/hi
    torch.testing.assert_close(
        rollout_rejection_mask(old, roll, mask, option, spec),
        ref_rejection(old, roll, mask, option, str(spec)),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    "modes, thresholds",
    [
        ("token_k1,seq_mean_k3,seq_max_k2", "0.5_2.0,0.1,0.2"),
        ("token_k1, seq_mean_k3 ,seq_max_k2", "1.5"),  # one spec for all (k1: 1/1.5.._1.5)
        ("seq_sum_k1,token_k3,seq_mean_k1,seq_max_k3", "0.3_3, 0.2, 0.8_1.2, 0.5"),
        ("token_k2,token_k2", "0.04"),  # duplicates ignored
        (",".join(SINGLE), ",".join(SINGLE.values())),
    ],
)
@pytest.mark.parametrize("seed", [0, 5])
def test_combined_rejection_options(modes, thresholds, seed):
    old, roll, mask = batch(seed)
    got = rollout_rejection_mask(old, roll, mask, modes, thresholds)
    assert torch.equal(got, ref_rejection(old, roll, mask, modes, thresholds))


def test_combined_is_the_product_of_single_options():
    old, roll, mask = batch(7)
    single = [rollout_rejection_mask(old, roll, mask, o, SINGLE[o]) for o in ("token_k1", "seq_max_k3")]
    specs = f"{SINGLE['token_k1']},{SINGLE['seq_max_k3']}"
    both = rollout_rejection_mask(old, roll, mask, "token_k1,seq_max_k3", specs)
    assert torch.equal(both, single[0] * single[1])


def test_seq_max_of_an_empty_row_is_zero_and_seq_mean_has_eps():
    old = torch.zeros(2, 2, dtype=F64)
    roll = torch.tensor([[-0.5, 0.0], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=F64)
    # empty row: max = 0 <= any positive bound -> nothing to reject, no -inf / NaN
    assert rollout_rejection_mask(old, roll, mask, "seq_max_k2", 1e-9).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    k2 = 0.5 * 0.5**2
    at_eps = k2 / (1.0 + 1e-8)  # veRL's masked_mean divides by count + 1e-8 (visible with a float64 mask)
    assert rollout_rejection_mask(old, roll, mask, "seq_mean_k2", repr(at_eps)).tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert rollout_rejection_mask(old, roll, mask, "seq_sum_k2", repr(at_eps)).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_rejection_keeps_mask_dtype_and_clamps():
    old, roll, mask = batch(0, torch.float32)
    got = rollout_rejection_mask(old, roll, mask.bool(), "token_k3", 1e7)  # k3(20) = e^20 - 21 > 1e7, k3(-20) = 19
    assert got.dtype == torch.bool
    assert not got[2, 1] and got[4, 0] and got[0, 0]
    unclamped = rollout_rejection_mask(old, roll, mask, "token_k2", 250.0)  # k2(+-20) = 200 <= 250 despite |d| > 20
    assert unclamped[2, 1] == 1 and unclamped[4, 0] == 1


@pytest.mark.parametrize(
    "modes, thresholds, match",
    [
        ("token_k4", "1.5", r"modes='token_k4'; accepted: .*seq_max_k3"),
        ("", "1.5", r"modes=''"),
        (None, "1.5", r"modes=None"),
        ("token_k1", None, r"thresholds=None .*lo_hi"),
        ("token_k2", "0.1_0.2", r"thresholds='0.1_0.2'.*k2, k3: a number"),
        ("token_k1", "2_1", r"thresholds='2_1'"),
        ("token_k1", "0_1", r"thresholds='0_1'"),
        ("token_k3", "-1", r"thresholds='-1'"),
        ("token_k3", 0, r"thresholds=0"),
        ("token_k1,token_k2,token_k3", "1.5,0.1", r"one per option"),
        ("token_k2,token_k2", "0.1,0.2", r"one per option"),  # counted after dropping duplicates
        ("token_k2", "abc", r"thresholds='abc'"),
    ],
)
def test_rejection_errors(modes, thresholds, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        rollout_rejection_mask(x, x, torch.ones(1, 2), modes, thresholds)


# ---------------------------------------------------------------- offpolicy_metrics
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_offpolicy_metrics_match_reference(seed):
    old, roll, mask = batch(seed)
    got, want = offpolicy_metrics(old, roll, mask), ref_offpolicy(old, roll, mask)
    assert list(got) == list(want)  # veRL's keys, in veRL's order
    assert all(isinstance(v, float) for v in got.values())
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


def test_offpolicy_metrics_count_empty_rows_and_vanish_on_policy():
    old = torch.tensor([[-1.0, -2.0], [-5.0, -5.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)
    m = offpolicy_metrics(old, old, mask)
    assert m["training_ppl"] == pytest.approx((math.exp(1.5) + 1.0) / 2)  # the empty row adds exp(0) = 1
    assert m["training_log_ppl"] == pytest.approx(0.75)
    for key in ("kl", "k3_kl", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff"):
        assert m[key] == pytest.approx(0.0, abs=1e-12), key
    assert m["chi2_token"] == pytest.approx(2 / (2 + 1e-8) - 1, abs=1e-15)  # masked_mean's + 1e-8 (float64 mask)
    assert m["ppl_ratio"] == pytest.approx(1.0)


# ---------------------------------------------------------------- rollout_correction_metrics
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_5.0", 1e12])
@pytest.mark.parametrize("seed", [0, 1])
def test_correction_metrics_match_reference(level, threshold, seed):
    old, roll, mask = batch(seed)
    new_mask = ref_rejection(old, roll, mask, "token_k1,seq_max_k2", "0.75_1.25,0.3")
    got = rollout_correction_metrics(old, roll, mask, level, threshold, new_mask)
    want = ref_metrics(old, roll, mask, level, threshold, new_mask)
    assert sorted(got) == sorted(want)
    for key in want:  # veRL takes some fractions in float32 (.float().mean())
        assert got[key] == pytest.approx(want[key], rel=1e-7 if "fraction" in key else 1e-9, abs=1e-12), key


def test_correction_metrics_sequence_extremes_are_unclamped_and_partial_keys():
    old, roll, mask = batch(0)
    m = rollout_correction_metrics(old, roll, mask, "sequence", 2.0)
    assert m["rollout_is_max"] == pytest.approx(math.exp(20))  # the row sum is 24, max clamps at 20
    assert m["rollout_is_min"] < math.exp(-20)  # the row with -23 is not clamped
    assert not any(k.startswith("rollout_rs") for k in m)
    assert set(rollout_correction_metrics(old, roll, mask, new_mask=mask)) == {
        "rollout_rs_masked_fraction",
        "rollout_rs_seq_masked_fraction",
    }
