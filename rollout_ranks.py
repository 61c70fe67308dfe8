"""Rollout ranks beside the trainer ranks: in one torchrun job, the last R ranks only generate (each with its own
vLLM engine) and the first T only train (FSDP2 over a process group of their own), so that generation and the
update can run at the same time. Imports torch only: grpo.py hands in the functions it needs (tools below).

    torchrun --nproc_per_node 3 grpo.py --config tiny.yaml rollout.n_gpus_per_node=1 \
        async_training.staleness_threshold=1 algorithm.rollout_correction.rollout_is=token

R = rollout.nnodes x rollout.n_gpus_per_node (veRL's one-step-off-policy recipe spells the rollout's resources so).
Everything a trainer rank does is the colocated run's, in a world of T ranks: its default process group holds
the trainer ranks only. A rollout rank j serves the trainer ranks r with r % R == j: it samples and scores each
one's prompts exactly as that rank's own engine would (the same prompts, the same seeds), and sends it the scored
groups. Two more process groups join the roles: "job" (gloo, every rank: the batches and small messages) and
"weights" (trainer rank 0 and the rollout ranks; NCCL on GPUs, gloo on CPU): after each update trainer rank 0
broadcasts the full weights, which each rollout rank loads into its engine and proves bit for bit (sync.py's
proof: the trainer's bit sums = what arrived = what the engine computes with).

The staleness bound k (async_training.staleness_threshold): batch s may be sampled by the weights of step
s - 1 - k at the oldest. k = 0 is synchronous (the colocated run, step for step); with k >= 1 a rollout rank
samples the next batch while the trainers train on the current one:

    k = 0   rollout  | gen 1 |            | gen 2 |            | gen 3 |
            trainer          | train 1 |->        | train 2 |->         ...     (-> : weights sent)
    k = 1   rollout  | gen 1 | gen 2 |   | gen 3 |   | gen 4 |
            trainer          | train 1 |->| train 2 |->| train 3 |->          (batch s+1: the weights before step s)

Batch s is always sampled from generation batch s's prompts (the cursor travels with it), so a resumed run
samples again what a stop lost and trains on no batch twice. Each sample records the policy version that drew it
(the batch field policy_version: the step whose weights sampled it, 0 for the start). The rollout correction
(required for k >= 1) weighs the samples against the current policy, with vLLM's log-probs as the sampling
policy's. The trainer keeps the last k versions of its weights (its own shards): every trainer.sync_check_every
steps it computes a stale batch's log-probs under the policy that sampled it, and rollout/logprob_diff_* compares
vLLM's with those (the sync proof; every push is also proven bit for bit on each rollout rank).

Every message between a trainer rank and a rollout rank names what it answers: its kind, the job rank it is for,
and the step or weights version it belongs to; the receiver checks them (a mismatch stops the run in one line).
A stop signal (SIGTERM, SIGINT) to any rank ends the job after the step, with a checkpoint: a rollout rank's
travels with its acknowledgement of the step's weights to the trainer ranks' stop vote; on a stop, every rollout
rank receives the outcome in place of the next weights.
"""

import collections
import copy
import datetime
import os
import pickle
import signal
import time
import types

import torch
import torch.distributed as dist

LINK_TIMEOUT = datetime.timedelta(hours=3)  # a rollout rank waits a whole training step for the next weights


class RolloutRanksError(ValueError):
    """Settings or a topology the rollout ranks cannot serve, or a rollout rank's failure; the message is one line."""


class LinkBroken(RuntimeError):
    """The other side of a send or receive is gone (its process ended: a stop signal, an error)."""


# ----------------------------------------------------------------------------------------- settings
def rollout_ranks(cfg: dict) -> int:
    """R: the ranks that only generate (rollout.nnodes x rollout.n_gpus_per_node; 0: every rank trains and
    generates, the colocated run)."""
    return cfg["rollout"]["nnodes"] * cfg["rollout"]["n_gpus_per_node"]


def check_settings(cfg: dict, world: int) -> None:
    """One line (RolloutRanksError) for a topology this file cannot run, before anything loads: R rollout ranks of a
    job of `world` ranks leave T = world - R >= 1 trainer ranks, each served by one rollout rank (R <= T); k >= 1
    needs the rollout correction or bypass mode (a stale batch must be weighed against the current policy); and
    what a rollout rank does not serve: DAPO's dynamic sampling (a step of several generation batches), replayed
    batches and val_only (no trainer or no engine), a Mixture-of-Experts routing replay."""
    n, k = rollout_ranks(cfg), cfg["async_training"]["staleness_threshold"]
    nodes, per_node = cfg["rollout"]["nnodes"], cfg["rollout"]["n_gpus_per_node"]
    where = f"rollout.nnodes x rollout.n_gpus_per_node = {nodes} x {per_node}"
    if n == 0:
        if k:
            raise RolloutRanksError(
                f"config: async_training.staleness_threshold = {k} needs rollout ranks (rollout.n_gpus_per_node "
                ">= 1): colocated ranks always sample with the newest weights"
            )
        return
    if n > world:
        raise RolloutRanksError(
            f"config: {where} = {n} rollout ranks, more than the {world} rank(s) of the job (torchrun "
            "--nproc_per_node x --nnodes); accepted: fewer than the world"
        )
    if n == world:
        raise RolloutRanksError(
            f"config: {where} = {n} rollout ranks in a job of {world} rank(s) leaves no trainer rank; accepted: "
            "fewer than the world"
        )
    if n > world - n:
        raise RolloutRanksError(
            f"config: {where} = {n} rollout ranks for {world - n} trainer rank(s): each rollout rank serves whole "
            f"trainer ranks, so at most {world - n}"
        )
    correction = cfg["algorithm"]["rollout_correction"]
    if k >= 1 and not (correction["rollout_is"] or correction["rollout_rs"] or correction["bypass_mode"]):
        raise RolloutRanksError(
            f"config: async_training.staleness_threshold = {k} trains on samples of an older policy: set "
            "algorithm.rollout_correction.rollout_is (token or sequence), rollout_rs, or bypass_mode=true"
        )
    refused = {
        "algorithm.filter_groups.enable": cfg["algorithm"]["filter_groups"]["enable"],
        "trainer.replay_batches": cfg["trainer"]["replay_batches"],
        "trainer.val_only": cfg["trainer"]["val_only"],
        "actor.router_replay.mode": cfg["actor"]["router_replay"]["mode"] != "disabled",
        "rollout.enable_rollout_routing_replay": cfg["rollout"]["enable_rollout_routing_replay"],
    }
    for key, on in refused.items():
        if on:
            raise RolloutRanksError(f"config: {key} is not served by rollout ranks ({where} = {n}); set it off")


# ------------------------------------------------------------------------------------ the process groups
def join(n_rollout: int) -> types.SimpleNamespace:
    """Build the roles' process groups under torchrun, before anything else touches torch.distributed: the
    default group of this rank's role (the trainer ranks 0..T-1, or the rollout ranks T..W-1), "job" over every
    rank (gloo) and "weights" over trainer rank 0 and the rollout ranks. Returns the link: role ("train" or
    "rollout"), rank and world (the job's), trainers (T), rollouts (their job ranks), job, weights (None on
    trainer ranks but 0)."""
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = (store.add("flatgrpo/joined", 1) - 1) // world  # as fsdp_train.init_distributed: restarts apart
    trainers = world - n_rollout
    role = "train" if rank < trainers else "rollout"
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    role_rank, role_world = (rank, trainers) if role == "train" else (rank - trainers, n_rollout)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo",
        store=dist.PrefixStore(f"attempt_{attempt}/{role}", store),
        rank=role_rank,
        world_size=role_world,
    )
    job = dist.ProcessGroupGloo(dist.PrefixStore(f"attempt_{attempt}/job", store), rank, world, LINK_TIMEOUT)
    weights = None
    if rank == 0 or role == "rollout":
        weights_store = dist.PrefixStore(f"attempt_{attempt}/weights", store)
        member = 0 if rank == 0 else 1 + rank - trainers
        if cuda:  # NCCL: the weights travel GPU to GPU
            weights = dist.ProcessGroupNCCL(weights_store, member, 1 + n_rollout)
        else:
            weights = dist.ProcessGroupGloo(weights_store, member, 1 + n_rollout, LINK_TIMEOUT)
    return types.SimpleNamespace(
        role=role,
        rank=rank,
        world=world,
        trainers=trainers,
        rollouts=list(range(trainers, world)),
        job=job,
        weights=weights,
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
    )


def server_of(link, trainer_rank: int) -> int:
    """The job rank of the rollout rank that serves trainer_rank."""
    return link.rollouts[trainer_rank % len(link.rollouts)]


def served_by(link, rollout_rank: int) -> list[int]:
    """The trainer ranks that the rollout rank (a job rank) serves."""
    return [r for r in range(link.trainers) if server_of(link, r) == rollout_rank]


def send_object(pg, obj, dst: int) -> None:
    """A picklable object to job rank dst over pg (its size, then its bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    finish(lambda: pg.send([size], dst, 0), f"job rank {dst}")
    finish(lambda: pg.send([payload], dst, 1), f"job rank {dst}")


def recv_object(pg, src: int):
    """The next object job rank src sent over pg (send_object)."""
    size = torch.zeros(1, dtype=torch.int64)
    finish(lambda: pg.recv([size], src, 0), f"job rank {src}")
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    finish(lambda: pg.recv([payload], src, 1), f"job rank {src}")
    return pickle.loads(payload.numpy().tobytes())


def broadcast_tensor(pg, tensor: torch.Tensor) -> None:
    """tensor from the weights group's member 0 (trainer rank 0) to every member, in place."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    finish(lambda: pg.broadcast([tensor], opts), "a member of the weights group")


def finish(start, peer: str) -> None:
    """Start a send, receive or broadcast (start()) and wait for it; LinkBroken when the peer's process is gone."""
    try:
        start().wait()
    except RuntimeError as e:
        raise LinkBroken(f"{peer} is gone, its process ended ({str(e).splitlines()[0][-160:]})") from None


# ---------------------------------------------------------------------------------------------- messages
def send(link, dst: int, kind: str, **fields) -> None:
    """A message to job rank dst over the job group: {"kind", "to": dst, its ids (step: the batch's or the
    validation's, version: the weights'), its contents}, so that the receiver can check what it answers."""
    send_object(link.job, {"kind": kind, "to": dst, **fields}, dst)


def receive(link, src: int, kinds: tuple, **ids) -> dict:
    """The next message from job rank src, checked against what this rank waits for: one of `kinds`, for this rank,
    with these ids (step, version); anything else is one line naming what was expected and what was received
    (RolloutRanksError), never read by its place in the stream. LinkBroken when src is gone."""
    message = recv_object(link.job, src)
    want = {"to": link.rank, **ids}
    got = {key: message.get(key) for key in ("kind", *want)} if isinstance(message, dict) else {"kind": message}
    if got["kind"] not in kinds or any(got.get(key) != value for key, value in want.items()):
        expected = " or ".join(kinds) + "".join(f", {key} {value}" for key, value in want.items())
        received = ", ".join(f"{key} {value}" for key, value in got.items())
        raise RolloutRanksError(f"job rank {link.rank}: expected {expected} from job rank {src}, received {received}")
    return message


def from_rollout(link, src: int, kinds: tuple, **ids) -> dict:
    """receive from rollout rank src on a trainer rank; one line when that rank is gone (its own line, printed
    before it ended, says why)."""
    try:
        return receive(link, src, kinds, **ids)
    except LinkBroken as e:
        raise RolloutRanksError(f"rollout rank {src} ended the run (its error line above says why): {e}") from None


# ------------------------------------------------------------------------------------------- the parts
def by_role(cfg: dict, tools: types.SimpleNamespace):
    """The run of a rollout-ranks job (grpo.main's run mode, after check_settings): by_role(cfg, parts) -> exit status,
    the training loop on the trainer ranks (tools.train with this file's Mode: start_engine, next_batch,
    update_weights, validate and stop_vote talk to the rollout ranks), generation on the rollout ranks (serve).
    tools: grpo's functions (train, mode, engine_run, next_groups, groups_to_batch, compute_logprobs, validate,
    with_bit_sums, check_push, engine_dtype, engine_dtypes, fit_to_engine, positions, stop_requested,
    close); each side's run.model pushes (weights, buffers, push)."""
    state = types.SimpleNamespace(
        link=None,
        kept={},
        k=cfg["async_training"]["staleness_threshold"],
        every=cfg["trainer"]["sync_check_every"],
        signalled=0,  # trainer rank 0: the first stop signal a rollout rank reported
        tools=tools,
    )
    trainer_side = tools.mode(
        start_engine=lambda run, model_path, pushing: hello(run, pushing, state),
        next_batch=lambda run, step, t: receive_batch(run, step, t, state),
        update_weights=lambda run, step, t: update_weights(run, step, t, state),
        validate=lambda run, step: remote_validation(run, step, state),
        stop_vote=lambda run, step: stop_vote(run, step, state),
    )

    def train(cfg, parts):
        state.link = join(rollout_ranks(cfg))
        return tools.train(cfg, parts, trainer_side) if state.link.role == "train" else serve(cfg, parts, state)

    return train


# ------------------------------------------------------------------------------- the trainer ranks' side
def hello(run, pushing: bool, state) -> None:
    """start_engine on a trainer rank: tell the rollout ranks where the run starts (step, generation cursor),
    learn the engine's dtype, and send the start-up proof of the weights of step start - 1 (the weights themselves
    after a resume or with a LoRA adapter: pushing)."""
    link = state.link
    if run.rank == 0:
        for r in link.rollouts:
            send(link, r, "start", start=run.start, gen_cursor=run.gen_cursor)
    engine = [from_rollout(link, link.rollouts[0], ("engine",)) if run.rank == 0 else None]
    dist.broadcast_object_list(engine, src=0)  # the trainer ranks' own group
    run.engine_dtype = engine[0]["dtype"]  # for the weights' cast, and whether the run is exact (grpo.exact_run)
    pushing |= state.tools.fit_to_engine(run, engine[0]["dtypes"])  # tensors the engine keeps in another dtype
    send_weights(run, state, run.start - 1, pushing, when="start-up: ")
    if run.rank == 0:
        print(
            f"rollout ranks: {len(link.rollouts)} rollout rank(s) (job ranks {link.rollouts[0]}-{link.rollouts[-1]}) "
            f"serve {link.trainers} trainer rank(s); staleness bound {state.k}",
            flush=True,
        )


def send_weights(run, state, version: int, pushing: bool, when: str) -> None:
    """The trainer's full weights of step `version` (gathered shard by shard: every trainer rank takes part) to every
    rollout rank, with their bit sums by group; pushing=False: the sums only (the engine loaded those weights itself).
    Trainer rank 0 then waits for each rollout rank's acknowledgement that it loaded and proved them, which carries
    the stop signal that rank received, if any (for stop_vote)."""
    link, lead = state.link, run.rank == 0
    sums = {}
    weights = state.tools.with_bit_sums(run.model.weights(run.policy, run.engine_dtype), sums)
    for name, tensor in weights:
        if lead and pushing:
            send_tensor(link, version, name, tensor, buffer=False)
    if lead and pushing:  # the persistent buffers (most families have none), or the engine's reload resets them
        for name, tensor in run.model.buffers(run.policy, run.engine_dtype):
            send_tensor(link, version, name, tensor, buffer=True)
    if lead:
        for r in link.rollouts:
            send(link, r, "sums", version=version, sums=sums, when=when)  # the end of the tensors
        for r in link.rollouts:  # every acknowledgement read (an unread one blocks its rank), the first signal kept
            signalled = from_rollout(link, r, ("loaded",), version=version)["signal"]
            state.signalled = state.signalled or signalled


def send_tensor(link, version: int, name: str, tensor: torch.Tensor, buffer: bool) -> None:
    """One tensor of the weights of step `version` from trainer rank 0 to every rollout rank: its header over the job
    group, then its values broadcast over the weights group. buffer: a persistent buffer, loaded but not summed."""
    tensor = tensor.contiguous().to(link.device)
    for r in link.rollouts:
        header = dict(version=version, name=name, shape=tuple(tensor.shape), dtype=tensor.dtype, buffer=buffer)
        send(link, r, "tensor", **header)
    broadcast_tensor(link.weights, tensor)


def update_weights(run, step: int, t: dict, state) -> dict:
    """update_weights on a trainer rank: the new weights to the rollout ranks (they load and prove them)."""
    start = time.perf_counter()
    send_weights(run, state, step, pushing=True, when=f"step {step}: ")
    t["update_weights"] = time.perf_counter() - start
    return {}


def stop_vote(run, step: int, state) -> int:
    """stop_vote on a trainer rank, after step `step`: the stop signal of any rank of the job, the same on every
    rank (0: none). The trainer ranks' own (tools.stop_requested: their vote over their group) and the rollout
    ranks' (reported to trainer rank 0 with this step's acknowledgement of the weights: a signal to a rollout rank
    stops the run after the step it arrived in, or the next when it arrived after that acknowledgement). On a stop
    before the last step, the rollout ranks, which go on at once (nothing is sent when the run goes on), are
    waiting to hand over batch step + 1 and then for its weights: each trainer rank takes its batch and drops it
    (sampled again after the resume), and trainer rank 0 sends each rollout rank the stop in place of the weights;
    they end with the trainer ranks."""
    link = state.link
    signum = torch.tensor([max(state.tools.stop_requested(), state.signalled)], dtype=torch.int64)
    dist.broadcast(signum, src=0)  # trainer rank 0's holds the rollout ranks' signals
    signum = int(signum.item())
    if signum and step < run.total_steps:
        from_rollout(link, server_of(link, run.rank), ("batch",), step=step + 1)  # sampled ahead: dropped
        if run.rank == 0:
            for r in link.rollouts:
                send(link, r, "stop", version=step + 1, signal=signum)
    return signum


def receive_batch(run, step: int, t: dict, state) -> tuple[dict, dict]:
    """next_batch on a trainer rank: this rank's scored groups of batch `step` from its rollout rank, as a batch
    (grpo.groups_to_batch), with the staleness metrics. A batch sampled by weights older than the bound stops the
    run (never trained on). At k >= 1 each row records its staleness (batch["staleness"]); on a sync-check step
    (every trainer.sync_check_every steps) a stale batch gets batch["sampler_logprobs"], its log-probs under the
    weights that sampled it (the version kept at its step), for the sync proof rollout/logprob_diff_*; on the other
    steps a stale batch has no proof (a fresh one always has: the old-log-prob pass is its sampling policy's). The
    rollout correction needs no such pass: vLLM's log-probs are the sampling policy's."""
    link, k = state.link, state.k
    keep_weights(run, step, state)
    start = time.perf_counter()
    message = from_rollout(link, server_of(link, run.rank), ("batch",), step=step)
    wait = time.perf_counter() - start
    version, staleness = message["version"], step - 1 - message["version"]
    if not 0 <= staleness <= k:
        raise RolloutRanksError(
            f"step {step}: received batch {step} sampled by the weights of step {version}; accepted: the weights of "
            f"steps {max(0, step - 1 - k)}-{step - 1} (async_training.staleness_threshold = {k})"
        )
    run.gen_cursor = message["gen_cursor"]
    batch = state.tools.groups_to_batch(message["groups"], run.pad_id)
    if k:
        batch["staleness"] = torch.full((batch["input_ids"].shape[0],), float(staleness))  # [B]
    if staleness and sync_check_step(step, state.every):
        t0 = time.perf_counter()
        batch["sampler_logprobs"] = sampler_logprobs(run, batch, state.kept[version], state)
        t["sampler_log_prob"] = time.perf_counter() - t0
    t.update(message["timing"])  # gen, reward, push_proof: the rollout rank's
    generation, last = message["timing"]["gen"] + message["timing"]["reward"], message["last"]
    return batch, {
        "fully_async/staleness": float(staleness),
        "fully_async/count/current_param_version": float(step - 1),
        "fully_async/total_wait_time": wait,
        "fully_async/overlap": min(1.0, max(0.0, 1.0 - wait / generation)) if generation > 0 else 0.0,
        "fully_async/rollouter/wait_time": last["waited"],
        "fully_async/rollouter/idle_ratio": last["waited"] / last["iteration"] if last["iteration"] > 0 else 0.0,
    }


def sync_check_step(step: int, every: int) -> bool:
    """Is `step` one of the sync proof's steps (trainer.sync_check_every; 0: none)?"""
    return every > 0 and step % every == 0


def keep_weights(run, step: int, state) -> None:
    """Before step `step` updates them: keep this rank's shards of the current weights (version step - 1) while a
    batch may still come from them (the next k steps), drop the older ones. None at k = 0, or without sync-check
    steps (trainer.sync_check_every = 0: no pass ever needs them)."""
    if state.k == 0 or state.every == 0:
        return
    state.kept[step - 1] = [p.detach().clone() for p in run.policy.parameters()]
    for version in [v for v in state.kept if v < step - 1 - state.k]:  # batch `step`: from step - 1 - k on
        del state.kept[version]


def sampler_logprobs(run, batch: dict, kept: list, state) -> torch.Tensor:
    """The batch's log-probs [B, R] under the kept weights (the policy that sampled it): swapped in, computed as
    the old-log-prob pass computes them, swapped back."""
    params = list(run.policy.parameters())
    with torch.no_grad():
        live = [p.detach().clone() for p in params]
        for p, w in zip(params, kept, strict=True):
            p.copy_(w)
    try:
        logprobs, _ = state.tools.compute_logprobs(run, run.policy, batch)
    finally:
        with torch.no_grad():
            for p, w in zip(params, live, strict=True):
                p.copy_(w)
    return logprobs


def remote_validation(run, step: int, state) -> dict:
    """testing on a trainer rank: the rollout ranks validate the weights they just proved; rollout rank 0's metrics,
    on every trainer rank."""
    link = state.link
    metrics = [from_rollout(link, link.rollouts[0], ("validation",), step=step)["metrics"] if run.rank == 0 else None]
    dist.broadcast_object_list(metrics, src=0)
    return metrics[0]


# ------------------------------------------------------------------------------- the rollout ranks' side
def serve(cfg: dict, parts_, state) -> int:
    """A rollout rank's whole run: its engine (after the trainers have fetched the data and built their models),
    the start-up proof, validation at step 0, then per step: send batch s to the trainer ranks it serves, sample
    ahead while they train (batches up to s + k, with the weights it holds), receive, prove and acknowledge the
    weights of step s (or the trainer ranks' stop, in their place), validate them when it is a validation step. Returns
    the exit status: 0; 128 + the signal when the job stopped on one (any rank's, this one's included: its
    acknowledgements carry it)."""
    link, tools, k = state.link, state.tools, state.k
    stopped = catch_stop_signals({"signal": 0})
    try:
        run = setup_rollout(cfg, parts_, state, stopped)
        catch_stop_signals(stopped)  # again, once the engine has started (as the trainer ranks catch them then)
        held = run.start - 1  # the version of the weights the engine holds: those of step start - 1
        pending, ahead = collections.deque(), run.start
        last = {"waited": 0.0, "iteration": 0.0}  # the previous step's: seconds waiting for weights, in all
        for step in range(run.start, run.total_steps + 1):
            began = time.perf_counter()
            if not pending:
                pending.append(sample(run, ahead, held, state))
                ahead += 1
            send_batches(run, pending.popleft(), last, state)
            while ahead <= min(step + k, run.total_steps):  # overlaps the trainers' step
                pending.append(sample(run, ahead, held, state))
                ahead += 1
            start = time.perf_counter()
            first = receive(link, 0, ("tensor", "sums", "stop"), version=step)
            waited = time.perf_counter() - start
            if first["kind"] == "stop":  # the trainer ranks checkpoint step - 1 and end: what was sampled ahead is lost
                tools.close(run)
                return 128 + first["signal"]
            receive_weights(run, state, first, stopped)
            held = step
            if validation_step(cfg, step, run.total_steps):
                validate(run, step, state)
            last = {"waited": waited, "iteration": time.perf_counter() - began}
    except LinkBroken as e:  # the trainer ranks ended: they failed (their line says why), or were killed
        if stopped["signal"]:
            return 128 + stopped["signal"]
        print(f"rollout rank {link.rank}: the trainer ranks ended the run before its last step: {e}", flush=True)
        return 1
    tools.close(run)
    return 0


def catch_stop_signals(stopped: dict) -> dict:
    """SIGTERM / SIGINT on a rollout rank only set stopped["signal"] (the first one): the rank goes on serving, and
    its next acknowledgement of the weights carries the signal to the trainer ranks' stop vote (stop_vote), which
    ends every rank after the step, with a checkpoint."""

    def handler(signum, frame):
        stopped["signal"] = stopped["signal"] or signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stopped


def setup_rollout(cfg: dict, parts_, state, stopped: dict):
    """The rollout rank's Run (grpo's engine_run: data, engine) once trainer rank 0 says where the run starts; its
    engine's dtype to trainer rank 0; the start-up proof; validation at step 0 (as the colocated run)."""
    link, tools = state.link, state.tools
    start = receive(link, 0, ("start",))  # after the trainers fetched the model and data: read here, not fetched twice
    run = tools.engine_run(cfg, parts_)  # its engine's buffers as loaded: run.engine_buffers
    run.start, run.gen_cursor = start["start"], start["gen_cursor"]
    if link.rank == link.rollouts[0]:
        send(link, 0, "engine", dtype=tools.engine_dtype(run.llm), dtypes=tools.engine_dtypes(run.llm))
    receive_weights(run, state, receive(link, 0, ("tensor", "sums"), version=run.start - 1), stopped)
    trainer = cfg["trainer"]
    if trainer["val_before_train"] and trainer["val_every"] > 0 and run.start == 1:
        validate(run, 0, state)
    return run


def validation_step(cfg: dict, step: int, total: int) -> bool:
    every = cfg["trainer"]["val_every"]
    return every > 0 and (step % every == 0 or step == total)


def validate(run, step: int, state) -> None:
    """grpo.validate on the rollout ranks (their own group splits the prompts); rollout rank 0 sends the metrics."""
    metrics = state.tools.validate(run, step)
    if state.link.rank == state.link.rollouts[0]:
        send(state.link, 0, "validation", step=step, metrics=metrics)


def sample(run, step: int, version: int, state) -> dict:
    """Batch `step` for each trainer rank this rank serves: {trainer rank: message}. Each trainer rank's prompts
    are sampled and scored as its own engine would (grpo.next_groups with that rank's seed and positions, the
    prefix cache reset first, as a push leaves it), and each sample records the policy version that drew it."""
    link, tools = state.link, state.tools
    run.gen_cursor += 1
    messages = {}
    for r in served_by(link, link.rank):
        view = copy.copy(run)
        view.rank, view.positions, view.gen_cursor = r, tools.positions(run.cfg, link.trainers, r), run.gen_cursor - 1
        run.llm.reset_prefix_cache()
        t = {}
        groups, _ = tools.next_groups(view, t)
        for group in groups:
            for s in group["samples"]:
                s.fields["policy_version"] = ("row", float(version))
        messages[r] = {"step": step, "version": version, "gen_cursor": run.gen_cursor, "groups": groups, "timing": t}
    return messages


def send_batches(run, messages: dict, last: dict, state) -> None:
    """Each served trainer rank its batch, with this rank's previous step: the seconds it waited for the weights,
    and in all."""
    for r, message in messages.items():
        message["timing"]["push_proof"] = run.last_proof
        send(state.link, r, "batch", **message, last=last)


def receive_weights(run, state, first: dict, stopped: dict) -> None:
    """The weights whose first message (a tensor, or the bit sums alone) has come from trainer rank 0, loaded into
    the engine as they arrive and proven (the trainer's bit sums = the received ones = what the engine computes
    with), then acknowledged with the stop signal this rank received, if any. Without tensors (the start-up proof of
    weights the engine loaded itself) only the proof."""
    link, tools, version = state.link, state.tools, first["version"]
    arrived = {}

    received = {}

    def tensors(message):  # the weights summed as they arrive (received), the buffers after them loaded only
        while message["kind"] == "tensor":
            tensor = torch.empty(message["shape"], dtype=message["dtype"], device=link.device)
            broadcast_tensor(link.weights, tensor)
            named = [(message["name"], tensor)]
            yield from named if message["buffer"] else tools.with_bit_sums(named, received)
            message = receive(link, 0, ("tensor", "sums"), version=version)
        arrived["sums"] = message

    if first["kind"] == "tensor":
        run.model.push(run.llm, tensors(first))
    trainer = arrived.get("sums", first)
    t0 = time.perf_counter()
    if first["kind"] == "tensor" and received != trainer["sums"]:
        wrong = sorted(g for g in set(received) | set(trainer["sums"]) if received.get(g) != trainer["sums"].get(g))
        raise RolloutRanksError(f"{trainer['when']}the weights arrived changed in {', '.join(wrong)}")
    tools.check_push(run.llm, trainer["sums"], run.engine_buffers, when=trainer["when"])
    run.last_proof = time.perf_counter() - t0
    run.policy_version = version  # what the engine samples with from now (an agent's replies say it)
    send(link, 0, "loaded", version=version, signal=stopped["signal"])
