"""metrics.validation_metrics against a literal re-implementation of veRL 0.9.1's
trainer/ppo/metric_utils.py (bootstrap_metric, calc_maj_val, process_validation_metrics) and
trainer/ppo/ray_trainer.py `_val_metrics_update`."""

import os
import random
import sys
import time
from collections import defaultdict
from functools import partial

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import metrics  # noqa: E402
from metrics import validation_metrics  # noqa: E402

# ---- veRL, literally (global np.random, per-resample Python loops, dict-based voting) ----


def ref_bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    np.random.seed(seed)
    data_np = np.array(data, dtype=object)
    bootstrap_idxs = np.random.choice(len(data_np), size=(n_bootstrap, subset_size), replace=True)
    metric_results = np.empty((len(reduce_fns), n_bootstrap), dtype=np.float64)
    for fn_idx, reduce_fn in enumerate(reduce_fns):
        for boot_idx in range(n_bootstrap):
            metric_results[fn_idx, boot_idx] = reduce_fn(data_np[bootstrap_idxs[boot_idx]])
    return [(float(np.mean(r)), float(np.std(r))) for r in metric_results]


def ref_calc_maj_val(data, vote_key, val_key):
    vote2vals = defaultdict(list)
    for d in data:
        vote2vals[d[vote_key]].append(d[val_key])
    vote2cnt = {k: len(v) for k, v in vote2vals.items()}
    maj_vote = max(vote2cnt, key=vote2cnt.get)
    return vote2vals[maj_vote][0]


def ref_gen_ns(n_resps):
    if n_resps <= 1:
        return []
    ns, n = [], 2
    while n < n_resps:
        ns.append(n)
        n *= 2
    ns.append(n_resps)
    return ns


def ref_process_validation_metrics(data_sources, sample_uids, infos_dict, seed=42):
    data_src2uid2var2vals = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for sample_idx, data_source in enumerate(data_sources):
        var2vals = data_src2uid2var2vals[data_source][sample_uids[sample_idx]]
        for var_name, var_vals in infos_dict.items():
            var2vals[var_name].append(var_vals[sample_idx])
    data_src2uid2var2metric = {}
    for data_source, uid2var2vals in data_src2uid2var2vals.items():
        uid_dict = data_src2uid2var2metric.setdefault(data_source, {})
        for uid, var2vals in uid2var2vals.items():
            pred_vals = var2vals.get("pred")
            var_dict = uid_dict.setdefault(uid, {})
            for var_name, var_vals in var2vals.items():
                var_vals = [value for value in var_vals if value is not None]
                if not var_vals or isinstance(var_vals[0], str):
                    continue
                has_pred = (
                    pred_vals is not None
                    and len(pred_vals) == len(var_vals)
                    and all(pred is not None for pred in pred_vals)
                )
                n_resps = len(var_vals)
                metric = {f"mean@{n_resps}": float(np.mean(var_vals))}
                if n_resps > 1:
                    metric[f"std@{n_resps}"] = float(np.std(var_vals))
                    for n in ref_gen_ns(n_resps):
                        (bon_mean, bon_std), (won_mean, won_std) = ref_bootstrap_metric(
                            var_vals, n, [np.max, np.min], 1000, seed
                        )
                        metric[f"best@{n}/mean"], metric[f"best@{n}/std"] = bon_mean, bon_std
                        metric[f"worst@{n}/mean"], metric[f"worst@{n}/std"] = won_mean, won_std
                        if has_pred:
                            vote_data = [{"val": v, "pred": p} for v, p in zip(var_vals, pred_vals, strict=True)]
                            [(maj_mean, maj_std)] = ref_bootstrap_metric(
                                vote_data, n, [partial(ref_calc_maj_val, vote_key="pred", val_key="val")], 1000, seed
                            )
                            metric[f"maj@{n}/mean"], metric[f"maj@{n}/std"] = maj_mean, maj_std
                var_dict[var_name] = metric
    data_src2var2metric2uid_vals = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for data_source, uid2var2metric in data_src2uid2var2metric.items():
        for _uid, var2metric in uid2var2metric.items():
            for var_name, metric in var2metric.items():
                for metric_name, metric_val in metric.items():
                    data_src2var2metric2uid_vals[data_source][var_name][metric_name].append(metric_val)
    return {
        ds: {var: {m: np.mean(v) for m, v in m2v.items()} for var, m2v in var2m.items()}
        for ds, var2m in data_src2var2metric2uid_vals.items()
    }


def ref_val_metrics_update(data_sources, sample_uids, infos_dict):
    metric_dict = {}
    for data_source, var2metric2val in ref_process_validation_metrics(data_sources, sample_uids, infos_dict).items():
        core_var = "acc" if "acc" in var2metric2val else "reward"
        for var_name, metric2val in var2metric2val.items():
            n_max = max([int(name.split("@")[-1].split("/")[0]) for name in metric2val.keys()])
            for metric_name, metric_val in metric2val.items():
                if (
                    (var_name == core_var)
                    and any(metric_name.startswith(pfx) for pfx in ["mean", "maj", "best"])
                    and (f"@{n_max}" in metric_name)
                ):
                    metric_sec = "val-core"
                else:
                    metric_sec = "val-aux"
                metric_dict[f"{metric_sec}/{data_source}/{var_name}/{metric_name}"] = metric_val
    return metric_dict


def reference(samples):
    """Samples -> veRL's columnar inputs (every key a full-length list, None where a sample lacks it)."""
    keys = ["reward"] + list(dict.fromkeys(k for s in samples for k in s if k not in ("data_source", "uid", "reward")))
    infos = {k: [s.get(k) for s in samples] for k in keys}
    return ref_val_metrics_update([s["data_source"] for s in samples], [s["uid"] for s in samples], infos)


# ---- fixed inputs ----


def fixed_samples():
    rng = random.Random(0)
    out = []
    # "gsm8k": N = 8 and N = 4 prompts, float rewards and preds with ties; one prompt with a None pred
    for p in range(6):
        n = 8 if p % 2 == 0 else 4
        for i in range(n):
            pred = rng.choice("ab") if p != 3 else "abcd"[i]  # p=3: four different votes, ties everywhere
            out.append(
                {
                    "data_source": "gsm8k",
                    "uid": f"g{p}",
                    "reward": rng.choice([0.0, 1.0, 0.5]),
                    "pred": None if (p == 4 and i == 2) else pred,
                }
            )
    # "math": N = 3 with an extra "acc" (core var becomes acc), a string extra key, no preds at all
    for p in range(4):
        for _ in range(3):
            out.append(
                {
                    "data_source": "math",
                    "uid": ("m", p),
                    "reward": rng.uniform(-1, 1),
                    "acc": float(rng.random() < 0.5),
                    "format": rng.random(),
                    "note": "str",
                }
            )
    # "tiny": N = 1 prompts, and one prompt with N = 3 (mixed N, so n_max = 3)
    out += [{"data_source": "tiny", "uid": p, "reward": float(p % 2), "pred": str(p % 2)} for p in range(5)]
    # ... whose "extra" has a None: N = 2 for that var, and no voting (fewer values than preds)
    out += [
        {"data_source": "tiny", "uid": 99, "reward": r, "pred": v, "extra": e}
        for r, v, e in [(1.0, "x", 0.5), (0.0, "y", None), (0.0, "y", 1.0)]
    ]
    # "ints": int rewards, N = 8, all preds distinct vs. all equal
    for p in range(2):
        out += [{"data_source": "ints", "uid": p, "reward": i % 3, "pred": str(i) if p else "same"} for i in range(8)]
    rng.shuffle(out)  # order of samples within a prompt is kept; prompts interleave
    return out


def assert_same(got, want):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k in want:
        assert isinstance(got[k], float), k
        assert abs(got[k] - want[k]) <= 1e-12, (k, got[k], want[k])


def test_matches_verl_literal():
    samples = fixed_samples()
    got, want = validation_metrics(samples), reference(samples)
    assert_same(got, want)
    # the inputs exercise what they are meant to
    assert "val-core/math/acc/best@3/mean" in got and "val-aux/math/reward/mean@3" in got
    assert "val-aux/math/format/best@3/mean" in got and not any("/note/" in k for k in got)
    assert "val-core/gsm8k/reward/maj@8/mean" in got and "val-core/gsm8k/reward/maj@4/mean" not in got
    assert "val-aux/gsm8k/reward/maj@4/mean" in got and not any(k.startswith("val-core/math/reward") for k in got)
    assert "val-aux/tiny/reward/mean@1" in got
    assert "val-core/tiny/reward/maj@3/mean" in got and "val-aux/tiny/extra/best@2/mean" in got
    assert not any("/pred/" in k or "/extra/maj" in k for k in got)


def test_vote_ties_and_value():
    # a tie in every resample of size 2 with two different votes: the first one seen wins, its first value
    samples = [
        {"data_source": "d", "uid": 0, "reward": r, "pred": p}
        for r, p in [(1.0, "a"), (0.0, "b"), (0.3, "a"), (0.7, "b"), (0.2, "c")]
    ]
    assert_same(validation_metrics(samples), reference(samples))


def test_hand_computed():
    m = validation_metrics([{"data_source": "d", "uid": 0, "reward": r} for r in [1, 0, 0, 1]])
    assert m["val-core/d/reward/mean@4"] == 0.5 and m["val-aux/d/reward/std@4"] == 0.5
    assert {k for k in m if k.startswith("val-core")} == {
        "val-core/d/reward/mean@4",
        "val-core/d/reward/best@4/mean",
        "val-core/d/reward/best@4/std",
    }
    assert len(m) == 2 + 2 * 4  # k = 2, 4: best/worst mean/std
    # the docstring's example (preds a, b, b, a)
    m = validation_metrics(
        [{"data_source": "d", "uid": 0, "reward": r, "pred": p} for r, p in zip([1, 0, 0, 1], "abba", strict=True)]
    )
    assert {k.split("/", 3)[3]: round(m[k], 3) for k in m if k.endswith("mean") or "/mean@" in k} == {
        "mean@4": 0.5,
        "best@2/mean": 0.738,
        "worst@2/mean": 0.278,
        "maj@2/mean": 0.522,
        "best@4/mean": 0.926,
        "worst@4/mean": 0.082,
        "maj@4/mean": 0.514,
    }
    # N = 1: only mean@1, and it is core
    one = validation_metrics([{"data_source": "openai/gsm8k", "uid": u, "reward": float(u)} for u in range(4)])
    assert one == {"val-core/openai/gsm8k/reward/mean@1": 1.5}
    # best@2 of two identical values: mean = the value, std = 0; majority of one vote too
    two = validation_metrics([{"data_source": "d", "uid": 0, "reward": 0.25, "pred": "7"}] * 2)
    for stat in ("best", "worst", "maj"):
        assert two[f"val-{'aux' if stat == 'worst' else 'core'}/d/reward/{stat}@2/mean"] == 0.25
        assert two[f"val-{'aux' if stat == 'worst' else 'core'}/d/reward/{stat}@2/std"] == 0.0
    # prompt with all-distinct votes of size 2: the first pick of each resample decides
    idx = np.random.RandomState(42).choice(2, size=(1000, 2))
    d = validation_metrics(
        [{"data_source": "d", "uid": 0, "reward": r, "pred": p} for r, p in [(1.0, "a"), (0.0, "b")]]
    )
    assert d["val-core/d/reward/maj@2/mean"] == pytest.approx(np.array([1.0, 0.0])[idx[:, 0]].mean(), abs=1e-15)


def test_indices_and_global_rng_untouched():
    np.random.seed(42)
    want = np.random.choice(8, size=(1000, 4), replace=True)
    assert np.array_equal(np.random.RandomState(42).choice(8, size=(1000, 4), replace=True), want)
    for n, k in [(8, 4), (3, 2), (3, 3), (4, 4), (64, 32)]:  # the matrices metrics.py uses
        np.random.seed(42)
        assert np.array_equal(metrics._bootstrap_idx(n, k), np.random.choice(n, size=(1000, k), replace=True))
    np.random.seed(123)
    np.random.rand(3)
    before = np.random.get_state()
    getattr(metrics._bootstrap_idx, "cache_clear", lambda: None)()  # draw the indices afresh, not from a cache
    validation_metrics(fixed_samples())
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]


def test_fast():
    rng = random.Random(1)
    samples = [
        {"data_source": "openai/gsm8k", "uid": p, "reward": float(rng.random() < 0.6), "pred": str(rng.randint(0, 3))}
        for p in range(1319)
        for _ in range(8)
    ]
    t = time.process_time()  # CPU seconds: robust to a busy machine; veRL's literal loops take ~1 min here
    m = validation_metrics(samples)
    assert time.process_time() - t < 5.0
    assert "val-core/openai/gsm8k/reward/maj@8/mean" in m and len(m) == 2 + 3 * 6
