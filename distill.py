"""On-policy distillation, exactly as veRL 0.9.1 computes it (distillation.*): the student samples, a teacher scores
every sampled token, and the student learns from that dense per-token signal. Two ways of use, as veRL's: a
supervised loss added to the task's (use_policy_gradient=false), or the negative per-token loss as the advantage of
a PPO-clipped policy-gradient term (use_policy_gradient=true, the Thinking Machines recipe). Imports torch and the
components it extends: losses.py (the KL estimators, the policy loss) and fsdp_train.py (the teacher's pass, and
both models' forwards through the token-field door): copy the three files.

The loop enters here through its records (grpo.choose_parts, grpo.choose_model_parts), each a whole function
wrapped:
  parts            the step's: advantages (the teacher's pass first: teacher_part), loss (the distillation term
                   beside the task's: loss_part), update (forward_kl_topk: the student's top-k computed in the
                   update's own forward; veRL's metric names: update_part); the settings checked first
  checked_loader   the model's load: the teacher's directory and tokenizer checked against the student's before
                   the student loads (check_teacher: one line each)

  estimator_losses     compute_distillation_loss_reverse_kl_estimator: losses.kl_penalty(student, teacher)
  student_topk         fsdp/losses.py compute_forward_kl_topk, the part that needs the student's logits (a chunk)
  topk_token_values    the rest of it: the KL over the teacher's top-k, the masses, the overlap
  topk_metrics         losses.py compute_forward_kl_topk: the masses and overlaps over the response mask
  distillation_term    distillation_loss: the range metrics, the clamp, then supervised or policy-gradient
  teacher_topk         the teacher's top-k log-probs and ids per position (veRL: vLLM's prompt_logprobs)

veRL's files: verl/trainer/distillation/losses.py, verl/trainer/distillation/fsdp/losses.py,
verl/workers/config/distillation.py, verl/trainer/config/distillation/distillation.yaml. Shapes as in losses.py: B
responses, R response tokens, V the vocabulary, K = distillation_loss.topk; `mask` the response mask [B, R].

The per-token losses, student log-prob s = log q(y_t), teacher's t = log p(y_t) on the sampled token y_t:
  k1 / kl       s - t                          abs           |s - t|
  k2 / mse      (s - t)^2 / 2                  k3 / low_var_kl  exp(t - s) - (t - s) - 1 (clamped as kl_penalty)
  forward_kl_topk   sum_k p_k (log p_k - log q_k) over the teacher's top-K ids at each position, >= 0
Worked example (3-token vocabulary): q = [0.5, 0.3, 0.2], the teacher's top-2 ids [0, 2] with p = [0.6, 0.3]:
  forward_kl_topk = 0.6 ln(0.6 / 0.5) + 0.3 ln(0.3 / 0.2) = 0.2310; its gradient in the student's logits
  (sum_k p_k) q - p = [0.9 * 0.5 - 0.6, 0.9 * 0.3, 0.9 * 0.2 - 0.3] = [-0.15, 0.27, -0.12]

Where the top-k's positions come from (the token-field door, fsdp_train.token_fields): a "token" field of the batch
travels with its tokens into each micro-batch's packed forward, and a pre-hook of the model's decoder takes it out of
the call; here a hook after the decoder then computes, inside the model's own forward (FSDP2 has gathered its head),
on the final hidden states at the positions the field marks: the position that predicts each response token. The
teacher's pass marks each response token's place in the batch (PLACES); the update marks the teacher's top-k ids
there (IDS), and the student's log-softmax at them (chunked, recomputed in the backward, differentiable) goes to the
loss of the same micro-batch (train_step calls the loss right after each micro-batch's forward).
"""

import functools
import math
import time

import torch
from torch.utils.checkpoint import checkpoint

import fsdp_train
import losses

ESTIMATORS = losses.KL_KINDS  # kl, k1, abs, mse, k2, low_var_kl, k3: losses on the sampled token
TOPK = "forward_kl_topk"  # the teacher's top-K distribution at each position
KEY = "distillation.distillation_loss"
TEACHER_KEY = "distillation.teacher_models.teacher_model.model_path"
CLIP_RATIO_C = 3.0  # the dual clip of veRL's vanilla policy loss: config.get("clip_ratio_c", 3.0), no distillation key
PLACES = "distill_places"  # the teacher's pass: each response token's place in the [B, R] grid, -1 elsewhere
IDS = "distill_teacher_ids"  # the update: the teacher's top-K ids, -1 elsewhere
NEGATED = "_negated_max"  # a minimum the update reports negated, as a maximum (train_step reduces "_max" keys so)


class DistillError(ValueError):
    """A distillation setting, teacher or batch refused; the message is one line."""


def check_settings(cfg: dict) -> None:
    """What veRL's DistillationLossConfig and DistillationConfig refuse, refused in one line, from the config alone:
    no teacher path; k1 / kl as a supervised loss (its gradient does not depend on the teacher; veRL refuses k1, and
    kl is the same estimator); forward_kl_topk without topk; a topk or clip ratio out of range. (policy_loss_mode
    other than vanilla, several teachers and the keys veRL reads for a teacher's own GPUs are refused by config.py:
    unknown keys or values; the teacher's tokenizer and a topk above the vocabulary: check_teacher.)"""
    d = cfg["distillation"]
    s, path = d["distillation_loss"], d["teacher_models"]["teacher_model"]["model_path"]
    if not path:
        raise DistillError(
            f"config: distillation.enabled=true needs {TEACHER_KEY} (the teacher: a local directory, a hub id, or "
            "tiny_teacher), got null"
        )
    if s["loss_mode"] in ("k1", "kl") and not s["use_policy_gradient"]:
        raise DistillError(
            f"config: {KEY}.loss_mode = {s['loss_mode']} with {KEY}.use_policy_gradient=false: backpropagating k1 "
            "directly is incorrect, its gradient does not depend on the teacher's log-probs (veRL refuses it); use "
            "k1 with use_policy_gradient=true, or k3 / forward_kl_topk as the supervised loss"
        )
    if s["topk"] is not None and s["topk"] < 1:
        raise DistillError(f"config: {KEY}.topk = {s['topk']}; accepted: null or >= 1")
    if s["loss_mode"] == TOPK and s["topk"] is None:
        raise DistillError(
            f"config: {KEY}.loss_mode = forward_kl_topk needs {KEY}.topk (how many of the teacher's most likely "
            "tokens each position compares), got null"
        )
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        if s[key] is not None and s[key] < 0:
            raise DistillError(f"config: {KEY}.{key} = {s[key]}; accepted: >= 0")


def parts(cfg: dict, parts, resolve, load, scale_factor: float):
    """The step's parts for on-policy distillation (grpo.choose_parts), the settings checked first (check_settings):
    advantages: the teacher's pass first (teacher_part; the teacher loaded at the first step: load(resolve(its
    model_path), device)); loss: the task's loss and the distillation term (loss_part; scale_factor:
    seq-mean-token-sum-norm's divisor, config.loss_scale_factor); update: the student's top-k computed in the
    update's own forward (forward_kl_topk) and veRL's metric names (update_part). `student` carries the student's
    top-k of each of the update's forwards to the loss of the same micro-batch."""
    check_settings(cfg)
    student = []
    parts.advantages = teacher_part(cfg, parts.advantages, resolve, load)
    parts.loss = loss_part(cfg, parts.loss, student, scale_factor)
    parts.update = update_part(cfg, parts.update, student)
    return parts


# ------------------------------------------------------------------------------------------ the teacher
def teacher_directory(cfg: dict, resolve) -> str:
    """The teacher's local directory: resolve(distillation.teacher_models.teacher_model.model_path), as model.path
    is resolved (grpo.local_model: one of tiny.py's set-ups, a local directory, or a hub id fetched by each node's
    first rank); its one-line errors name the teacher's key."""
    path = cfg["distillation"]["teacher_models"]["teacher_model"]["model_path"]
    try:
        return resolve(path)
    except ValueError as e:  # model.path's errors (data.resolve_model), said of the teacher's key
        raise DistillError(str(e).replace("config: model.path = ", f"config: {TEACHER_KEY} = ", 1)) from None


def check_teacher(cfg: dict, student: str, teacher: str) -> None:
    """The teacher's directory against the student's: the same tokenizer (the same tokens with the same ids), or a
    DistillError naming both; a vocabulary padded to another size with that tokenizer is accepted (Qwen2.5-7B's
    embedding has 152,064 rows, 0.5B's 151,936); a topk above the vocabulary is not."""
    from transformers import AutoTokenizer

    s = cfg["distillation"]["distillation_loss"]
    student_tokenizer, teacher_tokenizer = (
        AutoTokenizer.from_pretrained(student),
        AutoTokenizer.from_pretrained(teacher),
    )
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise DistillError(
            f"config: {TEACHER_KEY} = {teacher!r}: the teacher's tokenizer ({len(teacher_tokenizer)} tokens, "
            f"{teacher}) is not the student's ({len(student_tokenizer)} tokens, {student}); on-policy distillation "
            "compares the two models' log-probs of the same token ids: use a teacher with the student's tokenizer"
        )
    if s["loss_mode"] == TOPK and s["topk"] > len(student_tokenizer):
        accepted = f"at most the vocabulary ({len(student_tokenizer)} tokens)"
        raise DistillError(f"config: {KEY}.topk = {s['topk']}; accepted: {accepted}")


def checked_loader(cfg: dict, load, resolve):
    """The model record's load (grpo.choose_model_parts): when the policy loads (a trainable model), the teacher
    first, without loading it: its directory (teacher_directory, resolve as there) and tokenizer checked against the
    policy's (check_teacher), so that a wrong teacher stops the run in one line before anything loads."""

    def load_after_the_teachers_check(path: str, **settings):
        if settings.get("trainable", True):
            check_teacher(cfg, path, teacher_directory(cfg, resolve))
        return load(path, **settings)

    return load_after_the_teachers_check


def teacher_part(cfg: dict, advantages, resolve, load):
    """The loop's advantages with the teacher's pass first (grpo.choose_parts wraps Parts.advantages): at the first
    call the teacher is loaded (load(teacher_directory, device): grpo.frozen_model, as the reference is; every rank
    calls the advantages in the same step, so its collectives meet), then each step the batch gets the teacher's
    log-probs (teacher_pass), then the task's advantages(run, batch) as before. Also logs timing_s/teacher (inside
    timing_s/adv; the first step's includes the load)."""
    s, actor = cfg["distillation"]["distillation_loss"], cfg["actor"]
    topk = s["topk"] if s["loss_mode"] == TOPK else None
    logprobs = functools.partial(
        fsdp_train.compute_logprobs,
        temperature=1.0,  # veRL's teacher: vLLM's prompt_logprobs, always at temperature 1, whatever the rollout's
        max_tokens=actor["ppo_max_token_len_per_gpu"],
        chunk_size=actor["logprob_chunk_size"],
    )
    teacher = {"outputs": []}  # the model, once loaded; with topk, what its decoder hands back each micro-batch

    def advantages_after_the_teacher(run, batch: dict) -> dict:
        start = time.perf_counter()
        if "model" not in teacher:
            teacher["model"] = load(teacher_directory(cfg, resolve), device=next(run.policy.parameters()).device)
            if topk is not None:
                vocab = run.policy.config.get_text_config().vocab_size  # the student's ids
                pick = functools.partial(teacher_chunks, k=topk, vocab=vocab, chunk_size=actor["logprob_chunk_size"])
                tap(teacher["model"], PLACES, pick, teacher["outputs"])
        teacher_pass(teacher["model"], batch, logprobs, topk, teacher["outputs"])
        return {**advantages(run, batch), "timing_s/teacher": time.perf_counter() - start}

    return advantages_after_the_teacher


def teacher_pass(teacher, batch: dict, logprobs, topk: int | None, outputs: list) -> None:
    """The teacher's log-probs on the student's exact token ids, at temperature 1: batch["teacher_logprobs"] [B, R],
    each sampled token's (logprobs: fsdp_train.compute_logprobs with the run's budget); with topk K, its K most likely
    tokens at each position instead: batch["teacher_logprobs"] and batch["teacher_ids"] [B, R, K] (teacher_topk, as
    the teacher's decoder hands them back: tap), 0 outside the response mask. The teacher routes by its own: the
    batch's other token fields (a Mixture-of-Experts policy's routing) stay out of its forward."""
    own = fsdp_train.token_fields(batch)
    view = {key: value for key, value in batch.items() if key not in own}
    if topk is None:
        batch["teacher_logprobs"], _ = logprobs(teacher, view)
        return
    b, width = batch["response_mask"].shape
    places = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)  # [B, P + R]
    places[:, -width - 1 : -1][scored(batch)] = torch.arange(b * width).view(b, width)[scored(batch)]
    logprobs(teacher, {**view, PLACES: places, "layouts": {**view.get("layouts", {}), PLACES: ("token", -1)}})
    values, ids = torch.zeros(b * width, topk), torch.zeros(b * width, topk, dtype=torch.long)
    for at, top_values, top_ids in outputs:  # one entry per micro-batch
        values[at], ids[at] = top_values, top_ids
    outputs.clear()
    batch["teacher_logprobs"], batch["teacher_ids"] = values.view(b, width, topk), ids.view(b, width, topk)


def scored(batch: dict) -> torch.Tensor:
    """[B, R] (bool): the response tokens the loss scores (the response mask), each predicted by the token before it
    (fsdp_train.pack's scored)."""
    width = batch["response_mask"].shape[1]
    return (batch["response_mask"] > 0) & batch["attention_mask"][:, -width:].bool()


def teacher_chunks(head, hidden: torch.Tensor, places: torch.Tensor, k: int, vocab: int, chunk_size: int) -> tuple:
    """The teacher's top-K at n positions, chunk by chunk (chunked): hidden [n, h], places [n] -> (places, log-probs
    [n, K], ids [n, K]) on the CPU (teacher_topk)."""
    values, ids = chunked(functools.partial(teacher_topk, head, k=k, vocab=vocab), chunk_size, hidden)
    return places.cpu(), values.cpu(), ids.cpu()


def teacher_topk(head, hidden: torch.Tensor, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's K most likely tokens at each position, among the first `vocab` ids (the student's; a teacher
    whose embedding is padded further has more): hidden [c, h] -> the K log-probs (log-softmax over all V, fp32, at
    temperature 1) and their ids, [c, K] each."""
    return torch.topk(torch.log_softmax(head(hidden).float(), dim=-1)[:, :vocab], k, dim=-1)


# ------------------------------------------------------------------------------------------ the student
def update_part(cfg: dict, update, student: list):
    """The loop's update (grpo.choose_parts wraps Parts.update). forward_kl_topk: the student's top-k in the update's
    own forward: the policy's decoder tapped at the first call (tap, student_chunks at the rollout's temperature), and
    during the update the batch carries the teacher's top-K ids as a token field (IDS: at the position that predicts
    each response token), so that each micro-batch's forward appends its student_topk values to `student` for its
    loss. Every mode: the minima veRL logs, reported negated as maxima (train_step reduces those), get their names
    back (finish_names)."""
    s, actor = cfg["distillation"]["distillation_loss"], cfg["actor"]
    tapped = []

    def update_with_the_students_topk(run, batch: dict, t: dict) -> dict:
        if s["loss_mode"] != TOPK:
            return finish_names(update(run, batch, t))
        check_teacher_fields(batch, "teacher_ids")
        if not tapped:
            temperature, chunk = cfg["rollout"]["temperature"], actor["logprob_chunk_size"]
            tap(run.policy, IDS, functools.partial(student_chunks, temperature=temperature, chunk_size=chunk), student)
            tapped.append(run.policy)
        ids = torch.full((*batch["input_ids"].shape, s["topk"]), -1, dtype=torch.int32)  # [B, P + R, K]
        width = batch["response_mask"].shape[1]
        ids[:, -width - 1 : -1][scored(batch)] = batch["teacher_ids"][scored(batch)].to(torch.int32)
        layouts = batch.setdefault("layouts", {})
        batch[IDS], layouts[IDS] = ids, ("token", -1)
        try:
            return finish_names(update(run, batch, t))
        finally:  # the field exists for the update's forwards only
            batch.pop(IDS)
            layouts.pop(IDS)

    return update_with_the_students_topk


def finish_names(metrics: dict) -> dict:
    """veRL's names for the minima the loss reported negated as maxima (NEGATED): key_negated_max -> key, the value
    negated back (0.0 - value: a minimum of 0 stays 0.0, not -0.0). E.g. {"actor/distillation/loss_min_negated_max":
    -0.5} -> {"actor/distillation/loss_min": 0.5}."""
    return {key.removesuffix(NEGATED): (0.0 - v if key.endswith(NEGATED) else v) for key, v in metrics.items()}


def tap(model, field: str, fn, outputs: list) -> None:
    """Hooks on the model's decoder for one token field (fsdp_train.token_fields: it travels with its tokens, laid
    out as the forward lays out input_ids): a pre-hook takes it out of the decoder's call (transformers would hand it
    on to the layers), and in a forward whose micro-batch carries it, a hook after the decoder appends to outputs
    fn(head, hidden [n, h], values [n, ...]): the model's head (fsdp_train.logits_head), the final hidden states at
    the n positions the field marks (a value >= 0) and the field's values there, in the order of the forward's
    tokens (row by row, the order of the response mask's tokens). It runs inside the model's own forward (the root
    module's: under FSDP2 the head's weights are gathered), with autograd where the forward has it."""
    taken = {}

    def take(module, args, kwargs):
        taken["field"] = kwargs.pop(field, None)

    def compute(module, args, output):
        values = taken.pop("field", None)
        if values is None:  # a forward without the field: another pass, or an empty micro-batch
            return
        values = values.flatten(0, 1)  # [T, ...]: the packed row's tokens (right-padded rows: b * L)
        marked = values.reshape(len(values), -1)[:, 0] >= 0  # [T]
        outputs.append(
            fn(fsdp_train.logits_head(model), output.last_hidden_state.flatten(0, 1)[marked], values[marked])
        )

    decoder = model.get_decoder()
    decoder.register_forward_pre_hook(take, with_kwargs=True)
    decoder.register_forward_hook(compute)


def chunked(fn, chunk_size: int, *inputs: torch.Tensor) -> tuple:
    """fn(*inputs) -> a tuple of tensors [n, ...], computed over chunks of the n positions as fsdp_train's
    chunked_logprobs cuts them (chunks of at most chunk_size, of equal sizes; <= 0 or n <= chunk_size: one piece),
    each chunk recomputed in the backward when autograd is on (torch.utils.checkpoint): no more than a chunk's [c, V]
    logits are held, whatever n is."""
    n = inputs[0].shape[0]
    if chunk_size <= 0 or n <= chunk_size:
        return fn(*inputs)
    pieces = [
        checkpoint(fn, *chunk, use_reentrant=False) if torch.is_grad_enabled() else fn(*chunk)
        for chunk in zip(*(x.tensor_split(math.ceil(n / chunk_size)) for x in inputs), strict=True)
    ]
    return tuple(torch.cat(outputs) for outputs in zip(*pieces, strict=True))


def student_chunks(head, hidden: torch.Tensor, ids: torch.Tensor, temperature: float, chunk_size: int) -> tuple:
    """The student's top-k values at n positions, chunk by chunk (chunked, recomputed in the backward): hidden [n, h],
    the teacher's ids [n, K] -> student_topk of head(hidden)."""
    piece = functools.partial(student_head_topk, head, temperature=temperature)
    return chunked(piece, chunk_size, hidden, ids.long())


def student_head_topk(head, hidden: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple:
    return student_topk(head(hidden), ids, temperature)


def student_topk(logits: torch.Tensor, teacher_ids: torch.Tensor, temperature: float) -> tuple:
    """What veRL's fsdp compute_forward_kl_topk needs of the student's logits, per position: logits [n, V] (as the
    head gives them) and the teacher's top-K ids [n, K] -> q [n, K], the log-softmax of logits / temperature (fp32,
    as the log-probs) at the teacher's ids, differentiable; and overlap [n, K] (bool): is each of the teacher's ids
    among the student's own top-K? The [n, V] tensors live only here: the caller passes a chunk of positions."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [n, V]
    with torch.no_grad():
        own = torch.topk(log_probs, k=teacher_ids.shape[-1], dim=-1).indices  # [n, K]
    overlap = (teacher_ids[:, :, None] == own[:, None, :]).any(-1)  # [n, K]
    return torch.gather(log_probs, dim=-1, index=teacher_ids), overlap


def student_values(student: list, mb: dict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's top-k values of this micro-batch, as its forward appended them to `student` (update_part),
    taken: q and overlap [b, R, K] at the response mask's tokens, 0 (False) elsewhere. A forward that appended none
    (an empty micro-batch) or values of other positions: none, or a DistillError (one line)."""
    taken, on = list(student), mb["response_mask"] > 0  # [b, R]
    student.clear()
    if not taken and not on.any():
        return torch.zeros(*on.shape, k), torch.zeros(*on.shape, k, dtype=torch.bool)
    if len(taken) != 1 or taken[0][0].shape[0] != on.sum():
        found = ", ".join(str(q.shape[0]) for q, _ in taken) or "none"
        raise DistillError(
            f"distillation: the update's forward gave the student's top-k at {found} positions, its micro-batch "
            f"scores {int(on.sum())} tokens (the loss must follow each micro-batch's forward, as train_step calls it)"
        )
    q, overlap = taken[0]  # [N, K] each
    return q.new_zeros(*on.shape, k).index_put((on,), q), overlap.new_zeros(*on.shape, k).index_put((on,), overlap)


def topk_token_values(q, overlap, teacher_logp, clamp=None) -> dict[str, torch.Tensor]:
    """veRL's fsdp compute_forward_kl_topk per position, after the student's logits (student_topk): q, overlap and the
    teacher's top-K log-probs [..., K] -> each [...]:
        student_mass = sum_k exp(q_k), teacher_mass likewise (before the clamp); with clamp: q, p clamped below at
        log_prob_min_clamp;
        loss = sum_k exp(p_k) (p_k - q_k)   (kl_divergence(log_q=q, log_p=p); negative values possible: the top-K
        masses do not sum to 1, the caller clamps at 0 after its metrics)
        overlap_count = how many of the teacher's ids are among the student's own top-K;
        overlap_token_advantage = mean over those of -exp(p_k) (p_k - q_k), 0 where none.
    Only loss carries a gradient (the rest are metrics)."""
    teacher = teacher_logp.float()
    student_mass, teacher_mass = q.detach().exp().sum(-1), teacher.exp().sum(-1)
    if clamp is not None:
        q, teacher = q.clamp_min(clamp), teacher.clamp_min(clamp)
    token_kl = teacher.exp() * (teacher - q)  # [..., K]
    count = overlap.sum(-1)
    advantage = (-token_kl.detach() * overlap).sum(-1) / count.clamp_min(1)
    return {
        "loss": token_kl.sum(-1),
        "student_mass": student_mass,
        "teacher_mass": teacher_mass,
        "overlap_count": count.to(token_kl.dtype),
        "overlap_token_advantage": torch.where(count > 0, advantage, torch.zeros_like(advantage)),
    }


def check_teacher_fields(batch: dict, *more: str) -> None:
    """The teacher's log-probs (and `more` fields) are in the batch, or a DistillError: a replay of batches dumped
    without distillation.enabled brings none."""
    missing = [key for key in ("teacher_logprobs", *more) if key not in batch]
    if missing:
        raise DistillError(
            f"distillation: the batch has no {', '.join(missing)} (a replay of batches dumped without "
            "distillation.enabled?): dump them with distillation on, or replay without it"
        )


def estimator_losses(logp: torch.Tensor, teacher_logp: torch.Tensor, mode: str) -> torch.Tensor:
    """veRL's compute_distillation_loss_reverse_kl_estimator: the sampled-token estimator of KL(student || teacher),
    losses.kl_penalty(student's log-probs, the teacher's, mode) [B, R] (mode k1 / kl, abs, k2 / mse, k3 /
    low_var_kl; k3 clamped to [-10, 10] as the KL loss is)."""
    return losses.kl_penalty(logp, teacher_logp, mode)


def topk_metrics(values: dict, mask: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """veRL's compute_forward_kl_topk (losses.py) metrics over the response tokens of one micro-batch (values:
    topk_token_values' [b, R] each): the student's and teacher's top-K masses (mean, min, max), overlap_ratio (the
    mean overlap count / K) and overlap_token_advantage (its mean over the tokens with an overlap, 0 without any).
    Means are masked means; an empty mask gives 0 means, +inf minima and -inf maxima."""
    on = mask.bool()
    overlapped = on & (values["overlap_count"] > 0)
    out = {"overlap_ratio": losses.masked_mean(values["overlap_count"], mask) / k}
    out["overlap_token_advantage"] = losses.masked_mean(values["overlap_token_advantage"], overlapped.to(mask.dtype))
    for name in ("student_mass", "teacher_mass"):
        mass = values[name].detach()
        out[name] = losses.masked_mean(mass, mask)
        out[f"{name}_min"] = mass[on].min() if on.any() else torch.tensor(float("inf"))
        out[f"{name}_max"] = mass[on].max() if on.any() else torch.tensor(float("-inf"))
    return out


def distillation_term(per_token, logp, old_logp, mb: dict, s: dict, aggregate) -> tuple[torch.Tensor, dict]:
    """veRL's distillation_loss after the per-token losses: the range (loss_min, loss_max over the response tokens,
    before the clamp), the clamp to [-loss_max_clamp, loss_max_clamp], then
      use_policy_gradient=false:  aggregate(losses, mask), the supervised loss;
      use_policy_gradient=true:   PPO's clipped loss (losses.policy_loss, veRL's vanilla) with the advantage
          -losses (detached) at each token, old_logp as pi_old, distillation_loss's clip ratios (clip_ratio_low /
          high, each clip_ratio when null) and the dual clip 3, times the rollout correction's IS weights when mb has
          them, aggregated; metrics pg_clipfrac, ppo_kl, pg_clipfrac_lower (masked means).
    per_token, logp, old_logp [b, R]; aggregate(values, mask): losses.agg_loss with the actor's mode and the
    mini-batch's global counts. Returns (loss, metrics: loss_min, loss_max and the policy-gradient ones)."""
    mask = mb["response_mask"]
    on = mask.bool()
    metrics = {
        "loss_min": per_token.detach()[on].min() if on.any() else torch.tensor(float("inf")),
        "loss_max": per_token.detach()[on].max() if on.any() else torch.tensor(float("-inf")),
    }
    if s["loss_max_clamp"] is not None:  # the min clamps k1, which can be negative
        per_token = per_token.clamp(min=-s["loss_max_clamp"], max=s["loss_max_clamp"])
    if not s["use_policy_gradient"]:
        return aggregate(per_token, mask), metrics
    low = s["clip_ratio"] if s["clip_ratio_low"] is None else s["clip_ratio_low"]
    high = s["clip_ratio"] if s["clip_ratio_high"] is None else s["clip_ratio_high"]
    pg, parts = losses.policy_loss(logp, old_logp, -per_token.detach(), low, high, CLIP_RATIO_C)  # [b, R]
    if "is_weights" in mb:  # the rollout correction's
        pg = pg * mb["is_weights"]
    metrics.update({key: losses.masked_mean(part, mask) for key, part in parts.items()})
    return aggregate(pg, mask), metrics


def loss_part(cfg: dict, loss, student: list, scale_factor: float):
    """The update's loss builder (Parts.loss), veRL's distillation_ppo_loss: build(cfg, term) -> loss_fn(logp,
    entropy, mb, counts) as grpo.grpo_loss_fn's (loss: the builder it wraps, the task's), whose loss is
        use_task_rewards:       the task's loss + distillation_loss_coef * the distillation term
        not use_task_rewards:   the distillation term alone (veRL drops the task's whole loss, its KL and entropy
                                terms too; with use_policy_gradient its metrics are still logged)
    forward_kl_topk's student values come from the micro-batch's own forward (student: student_values).
    The metrics, veRL's names after its actor's "actor/" prefix: actor/distillation/loss (the term before the
    coefficient: summed over micro-batches and ranks, the mini-batch's value, as actor/pg_loss), abs_loss (the
    estimators), loss_min / loss_max, the top-K masses and overlaps (forward_kl_topk), pg_clipfrac, ppo_kl,
    pg_clipfrac_lower (use_policy_gradient); means weighted by the micro-batch's share of the tokens, as
    grpo_loss_fn's; minima negated as maxima (NEGATED: finish_names restores them after the update).
    scale_factor: seq-mean-token-sum-norm's divisor (config.loss_scale_factor)."""
    s, actor = cfg["distillation"]["distillation_loss"], cfg["actor"]

    def build(cfg: dict, term):
        task = loss(cfg, term)

        def loss_fn(logp, entropy, mb: dict, counts: dict):
            check_teacher_fields(mb)
            mask = mb["response_mask"]
            aggregate = functools.partial(
                losses.agg_loss,
                mode=actor["loss_agg_mode"],
                num_tokens=counts["num_tokens"],
                num_seqs=counts["num_seqs"],
                scale_factor=scale_factor,
            )
            share = mask.sum().item() / counts["num_tokens"]  # this micro-batch's share of the mini-batch tokens
            if s["loss_mode"] == TOPK:
                q, overlap = student_values(student, mb, s["topk"])  # [b, R, K] each
                values = topk_token_values(q, overlap, mb["teacher_logprobs"], s["log_prob_min_clamp"])
                shown = topk_metrics(values, mask, s["topk"])
                per_token = values["loss"].clamp_min(0.0)  # top-K masses need not sum to 1: clamped after the metrics
            else:
                per_token = estimator_losses(logp, mb["teacher_logprobs"], s["loss_mode"])
                shown = {"abs_loss": losses.masked_mean(per_token.detach().abs(), mask)}
            old = mb["old_logprobs"] if "old_logprobs" in mb else logp.detach()  # the on-policy shortcut: ratio 1
            distill, term_metrics = distillation_term(per_token, logp, old, mb, s, aggregate)
            shown.update(term_metrics)
            value, out = 0.0, {}
            if s["use_task_rewards"] or s["use_policy_gradient"]:
                task_value, out = task(logp, entropy, mb, counts)
                value = task_value if s["use_task_rewards"] else 0.0
            coef = s["distillation_loss_coef"] if s["use_task_rewards"] else 1.0
            out["actor/distillation/loss"] = distill.item()
            for key, metric in shown.items():
                if key.endswith("_min"):  # train_step reduces "_max" keys by the maximum
                    out[f"actor/distillation/{key}{NEGATED}"] = -float(metric)
                else:
                    out[f"actor/distillation/{key}"] = float(metric) * (1.0 if key.endswith("_max") else share)
            return value + coef * distill, out

        return loss_fn

    return build
