"""DAPO's controls (arXiv 2503.14476), exactly as veRL 0.9.1 computes them: dynamic sampling
(algorithm.filter_groups: keep sampling until enough groups carry a learning signal) and the soft overlong
punishment (reward.overlong_buffer). Standard library and torch only: copy it anywhere.

Entry points, each a part grpo.choose_parts chooses when its key is set:
  check_settings     reward.overlong_buffer's length within the response budget (DapoError, one line)
  reward_shaper      overlong_shaping, after check_settings (the rewards shaped by the responses' lengths)
  group_picker       dynamic_sampling: generation batches until train_batch_size groups have rewards that differ
                     (the groups a step trains on)

  nonzero_std_groups  trainer/ppo/v1/replay_buffer.py: _dapo_filtered_keys (numpy's float64 std, bit for bit)
  overlong_penalty    experimental/reward_loop/reward_manager/dapo.py: run_single
"""

import functools
import math
import struct
from functools import reduce
from operator import add

import torch
import torch.distributed as dist


class TooFewGroups(ValueError):
    """algorithm.filter_groups.max_num_gen_batches generation batches did not give enough groups; one line."""


class DapoError(ValueError):
    """DAPO settings this file cannot use; the message is one line."""


def check_settings(cfg: dict) -> None:
    """reward.overlong_buffer, when enabled: its length within the response budget, 0 < len <=
    data.max_response_length (DapoError, one line)."""
    buffer, budget = cfg["reward"]["overlong_buffer"], cfg["data"]["max_response_length"]
    if buffer["enable"] and not 0 < buffer["len"] <= budget:
        raise DapoError(
            f"config: reward.overlong_buffer.len = {buffer['len']}; accepted: 0 < value <= "
            f"data.max_response_length ({budget}) when the buffer is enabled"
        )


def group_picker(cfg: dict, next_prompts):
    """The loop's part that picks a step's groups (grpo.choose_parts): dynamic_sampling with the run's rollout.n,
    data.train_batch_size and algorithm.filter_groups.max_num_gen_batches, each generation batch sampled and scored
    by the run's own part (run.parts.sample_groups); picker(run, t) -> (groups, metrics)."""
    return functools.partial(
        dynamic_sampling,
        next_prompts=next_prompts,
        sample=lambda run, prompts, t: run.parts.sample_groups(run, prompts, t),
        n=cfg["rollout"]["n"],
        train_batch_size=cfg["data"]["train_batch_size"],
        max_num_gen_batches=cfg["algorithm"]["filter_groups"]["max_num_gen_batches"],
    )


def dynamic_sampling(run, t: dict, *, next_prompts, sample, n: int, train_batch_size: int, max_num_gen_batches: int):
    """DAPO's dynamic sampling as veRL's trainer runs it: generation batches are sampled and scored until
    train_batch_size groups with a reward signal (nonzero_std_groups) are kept, the first ones in generation
    order; each rank then takes its own positions of them (run.positions). next_prompts(run) -> the next generation
    batch's prompts (data.gen_batch_size of them); sample(run, prompts, t) -> their scored groups ({"rewards" [n],
    ...} each). Rank r samples prompts r, r + world, ...; every rank sees every group, in generation order. Returns
    (this rank's groups, {"train/num_gen_batches": generation batches used}); TooFewGroups after
    max_num_gen_batches (0: no limit) batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kept, gen_batches = [], 0  # kept: groups of n scored samples, in generation order
    while len(kept) < train_batch_size:
        if max_num_gen_batches and gen_batches == max_num_gen_batches:
            raise TooFewGroups(
                f"algorithm.filter_groups: {gen_batches} generation batches (max_num_gen_batches) gave "
                f"{len(kept)} of {train_batch_size} prompts whose rewards differ; raise it (0: no "
                "limit), or use data the policy neither always solves nor always fails"
            )
        prompts = next_prompts(run)
        gen_batches += 1
        groups = sample(run, prompts[rank::world], t)
        parts = [None] * world
        dist.all_gather_object(parts, groups)
        ordered = [parts[i % world][i // world] for i in range(len(prompts))]
        keep = nonzero_std_groups(torch.cat([g["rewards"] for g in ordered]), n)  # [gen_batch_size]
        kept += [group for group, k in zip(ordered, keep, strict=True) if k]
    return [kept[p] for p in run.positions], {"train/num_gen_batches": gen_batches}


def _np_pairwise_sum(xs: list[float]) -> float:
    """numpy's float64 add.reduce, bit for bit (numpy/_core/src/umath/loops_utils.h.src: pairwise_sum):
    < 8 values left to right; <= 128: 8 strided accumulators, combined ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)),
    then the remainder left to right; more: split at n/2 rounded down to a multiple of 8.
    (Not Python's sum(): since 3.12 it compensates.)  [0.1] * 3 -> 0.30000000000000004.
    """
    n = len(xs)
    if n > 128:
        half = n // 2 - (n // 2) % 8
        return _np_pairwise_sum(xs[:half]) + _np_pairwise_sum(xs[half:])
    tail = n - n % 8  # 0 when n < 8: all accumulators stay -0.0, the rest is summed left to right
    r = [reduce(add, xs[j:tail:8], -0.0) for j in range(8)]  # accumulator j: x_j + x_{j+8} + ...
    return reduce(add, xs[tail:], ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])))


def _np_std(xs: list[float]) -> float:
    """np.std(xs) (float64, ddof=0): sqrt(pairwise_sum((x - mean)^2) / n) with mean = pairwise_sum(x) / n."""
    mean = _np_pairwise_sum(xs) / len(xs)
    return math.sqrt(_np_pairwise_sum([(x - mean) * (x - mean) for x in xs]) / len(xs))


def nonzero_std_groups(rewards, n: int) -> list[bool]:
    """DAPO dynamic sampling: does each group of n consecutive rewards carry a learning signal? (veRL
    trainer/ppo/v1/replay_buffer.py: _dapo_filtered_keys drops a group iff n > 1 and float(np.std(values)) == 0.0)

    rewards (1-D tensor or list) are converted to float64 exactly (float32 included), then numpy's std is
    reproduced in pure Python (_np_std). Evidence for not using torch: over 30000 random groups of sizes
    1..1100 (repeated, near-equal and random values) _np_pairwise_sum / _np_std matched np.add.reduce / np.std
    bit for bit, while torch.float64 std(correction=0) disagreed with np.std on "== 0" in 1326 of 20000 groups
    (e.g. 119 x 0.1: numpy 1.4e-17, torch 0.0; 150 x -1.7699...: numpy 0.0, torch 6.7e-16).

    [1, 0, 1, 1, 1, 1], n=3 -> [True, False];  [0.1] * 3 -> [True] (1.4e-17);  [0.1] * 8 -> [False] (0.0).
    """
    values = [float(v) for v in (rewards.double().tolist() if torch.is_tensor(rewards) else rewards)]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or len(values) % n:
        raise ValueError(f"nonzero_std_groups: n={n!r}; accepted: an int >= 1 dividing len(rewards) = {len(values)}")
    return [n == 1 or _np_std(values[i : i + n]) != 0.0 for i in range(0, len(values), n)]


def _f32(x: float) -> float:
    """x rounded to float32 (round to nearest even) and back: struct's 'f' packs a C float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def reward_shaper(cfg: dict, scored_samples):
    """The loop's scored_samples with DAPO's overlong penalty added to the rewards (grpo.choose_parts), its settings
    checked first (check_settings): overlong_shaping of each scored sample, with the run's settings."""
    check_settings(cfg)

    def shaped(run, rows, t, **sampling):
        samples, rewards, extras = scored_samples(run, rows, t, **sampling)
        return samples, overlong_shaping(rewards, samples, cfg), extras

    return shaped


def overlong_shaping(rewards: torch.Tensor, samples: list, cfg: dict) -> torch.Tensor:
    """rewards [N] (float32) plus the overlong_penalty of each sample's response length (its response_ids, EOS
    included) with the run's data.max_response_length and reward.overlong_buffer (len, penalty_factor), added in
    float32 as veRL adds it."""
    budget, buffer = cfg["data"]["max_response_length"], cfg["reward"]["overlong_buffer"]
    lengths = [len(s.response_ids) for s in samples]
    penalties = [overlong_penalty(k, budget, buffer["len"], buffer["penalty_factor"]) for k in lengths]
    return rewards + torch.tensor(penalties, dtype=torch.float32)


def overlong_penalty(
    response_length: int, max_response_length: int, buffer_length: int, penalty_factor: float
) -> float:
    """DAPO's soft overlong punishment, bit-equal to veRL (experimental/reward_loop/reward_manager/dapo.py,
    run_single: reward += min(-exceed_len / overlong_buffer_len * penalty_factor, 0)).

    exceed = L - (Lmax - Lb);  penalty = min(-exceed / Lb * f, 0)  (L: response tokens, EOS included).
    veRL's L is a 0-d int64 tensor (an attention-mask sum), so torch evaluates in float32: a TRUE float32
    division f32(-exceed) / f32(Lb), rounded, then a float32 multiply by f32(f), rounded (measured: this matched
    torch on 131954 of 131954 random (L, Lmax, Lb, f); a float64 evaluation or a multiply by a float32
    reciprocal did not). Each rounding is done here with struct.pack('f', ...). Python's min(x, 0) returns the
    int 0 when x > 0 (no penalty; returned here as 0.0), else x: a float32 tensor in veRL, so score + x is
    float32 there too.

    Lmax = 20, Lb = 10, f = 1.0:  L = 10 -> 0.0;  L = 15 -> -0.5;  L = 20 -> -1.0.
    Lmax = 20, Lb = 10, f = 0.1:  L = 13 -> -0.030000001192092896 (float32), not -0.03.
    """
    if not buffer_length > 0 or max_response_length < buffer_length:
        raise ValueError(
            f"overlong_penalty: buffer_length={buffer_length!r} must be > 0 and max_response_length="
            f"{max_response_length!r} must be >= buffer_length (veRL's overlong_buffer checks)"
        )
    exceed = response_length - (max_response_length - buffer_length)
    penalty = _f32(_f32(_f32(-exceed) / _f32(buffer_length)) * _f32(penalty_factor))
    return 0.0 if penalty > 0 else penalty
