"""Keeping a job alive without a restart: replica groups that agree on a quorum every step
(torchft), one killed and healed live from a peer, against the same run under
checkpoint-restart.

The lab starts a lighthouse, torchft's quorum server, on 127.0.0.1, and --groups replica
groups of one rank each, on gloo (NCCL with a GPU per group). They train the course's
transformer data-parallel across the groups: every step each group asks the lighthouse for
a quorum, the participants average their gradients over torchft's process group, rebuilt
whenever the quorum changes, and a group applies the step only when the step may commit.
Group --late-group starts once the others have trained --late-at-step steps: its first
quorum finds it behind, and a peer sends it the whole state (model, optimizer, the data's
position) over the process group (torchft's PGTransport). Once the job trains with every
group, group --fail-group kills itself (SIGKILL) at step --fail-at-step or the first after
it. The survivors' step in flight fails, their next quorum leaves the dead group out, and
they go on with a smaller batch. The lab then starts the group again, and it heals; with
--die-in-heal that first return is killed as its heal begins, and a second one heals.
The state also carries a payload of --state-mb (one run of the job per value): a stand-in
for a larger model's state, copied by every heal but never trained, so steps stay short.
Each step's batch comes from one seeded order of the whole data set, whose position is in
the state (labkit.predict.fault_tolerance_model.global_order); the ids torchft's own
DistributedSampler would have drawn are recorded beside them. Last, the same job under
checkpoint-restart: group 0 saves every --every steps, the kill stops every group (as
torchrun does for its ranks), and all start again from the last checkpoint.

The groups are processes forked from this one once torch and torchft are imported, with
the environment torchrun would give a rank: import_s is what that import costs a group
started afresh (the CPU seconds of Python's start and the imports), and is not in heal_s. Each group hosts its own store on 127.0.0.1 (the
Manager joins it, as it joins torchrun's), everything it advertises is 127.0.0.1, and gloo
uses the loopback interface. torchft 0.2's Manager would start its server on [::], every
address (torchft/manager.py): the lab starts it on --hostname's address alone when that is
an IPv4 address (give the node's IP on a cluster; a name keeps torchft's bind). On a
cluster the groups must reach the lighthouse and each other's manager port, store and
collectives, and each group advertises its node's address: the Manager joins torchrun's
store at MASTER_ADDR, which --standalone would make localhost.

Launch lines (from the repository root):
  laptop, gloo on CPU:  python labs/fault_tolerance.py --out ft.json
  GPU box, NCCL:        python labs/fault_tolerance.py --backend nccl   (a GPU per group)
  a cluster, a replica group per node under its own torchrun, the lighthouse on HOST:
    torchft_lighthouse --bind HOST_ADDR:29510 --min_replicas 2 --join_timeout_ms 1000
    GLOO_SOCKET_IFNAME=IFACE torchrun --nnodes=1 --nproc_per_node=1 \\
             --master-addr=NODE_ADDR --master-port=29501 labs/fault_tolerance.py --group G \\
             --lighthouse http://HOST_ADDR:29510 --hostname NODE_ADDR --out group-G.json
    (one rank per group: a group of several ranks shards its model inside, HSDP, which
    this lab does not do)

JSON: `runs`, one per --state-mb: `state_bytes` (what a heal copies, counted exactly)
beside `predicted_state_bytes`, `replica_groups_per_step` (the participants of each
committed step), `killed_at_step`, `detect_s` (the death to the survivors' next quorum) and
`detect_window_s` (fault_tolerance_model.detection_window, with the rebuild measured),
`asked_s` (the death to the last survivor's failed step in flight), `decision_s` (to the
lighthouse's answer, when the survivors' rebuild began) beside `decision_window_s`
(fault_tolerance_model.quorum_issued_s, from asked_s), `rebuild_s`, `step_spread_s`,
`steps_lost_by_survivors` (steps they committed twice), `attempts_discarded` beside
`predicted_attempts_discarded`, `heals` [{group, start, why: late or return, step, heal_s
(its start to its first committed step), ready_s, copy_s beside predicted_copy_s, bytes,
tensors}], `heals_died`, `healed_param_max_diff` (every group's final parameters against
group 0's), `replay_param_max_diff` and `replay_fixed_param_max_diff` (group 0's final
parameters against a one-process replay of the committed steps, averaged over the
participants or over --groups), `step_s`, `quorum_s`, and `data_while_out` {global_order:
{skipped_samples beside predicted_skipped_samples, repeated_samples}, torchft_sampler:
{skipped_samples, repeated_samples, shard_lag_samples}}; the first run's
`replica_groups_per_step` and `detect_s`, and the largest `steps_lost_by_survivors` and
`healed_param_max_diff`, at the top; `heal_s` {state bytes: [seconds]}; `link` {latency_s,
bandwidth_bytes_per_s} (the transport timed on its own, measure_link); `checkpoint_restart`
{every, saved_steps, killed_at_step, resumed_from_step, steps_lost beside
predicted_steps_lost, group_steps_lost (the steps trained again times the groups, and the
others' step in flight), restart_s}; `import_s`; `timeouts`; `rules_broken`
(fault_tolerance_model.timeout_rules). With --group, one group's own `attempts` and `heals`
instead.
"""

import time

import argparse   # noqa: E402
import dataclasses   # noqa: E402
import datetime   # noqa: E402
import ipaddress   # noqa: E402
import json   # noqa: E402
import logging   # noqa: E402
import multiprocessing   # noqa: E402
import os   # noqa: E402
import re   # noqa: E402
import select   # noqa: E402
import signal   # noqa: E402
import socket   # noqa: E402
import statistics   # noqa: E402
import tempfile   # noqa: E402
import warnings   # noqa: E402
from pathlib import Path   # noqa: E402

os.environ.setdefault("RUST_LOG", "warn")   # torchft's Rust side logs every quorum at info
import torch   # noqa: E402
import torch._dynamo   # noqa: E402,F401  (imported once here, not by each forked group)
import torch.distributed as dist   # noqa: E402
from torch.utils._pytree import tree_leaves   # noqa: E402
try:   # torchft 0.2.0 needs torch >= 2.7: on an older box the lab says so, in one line
    from torchft import DistributedSampler, Manager, ProcessGroupGloo, ProcessGroupNCCL   # noqa: E402
    from torchft._torchft import LighthouseServer   # noqa: E402
    from torchft.checkpointing.pg_transport import PGTransport   # noqa: E402
except ImportError as missing:
    raise SystemExit(f"fault_tolerance: error: torchft does not import ({missing}); it needs "
                     f"torch >= 2.7, and this is torch {torch.__version__}: "
                     "pip install torchft==0.2.0 beside torch >= 2.7") from None

from labkit.model.transformer import (Shape, Transformer, add_shape_args,   # noqa: E402
                                      next_token_loss, shape_from_args)
from labkit.predict import fault_tolerance_model as ftm, memory_model   # noqa: E402
from labkit.runtime import distenv   # noqa: E402

# What starting Python and importing torch and torchft cost this process: its CPU time so far,
# the same whether it started afresh or was started before its launch with torch imported
# (a chapter's spare Python, labkit.runtime.spare_python), where its clock would show less
IMPORT_S = time.process_time()
logging.getLogger("torchft").setLevel(logging.CRITICAL)   # the lab reports what went wrong
warnings.filterwarnings("ignore", module="torchft")   # its deprecation warnings, not the lab's

# model and data
SHAPE = Shape(layers=2, hidden=32, heads=4, seq=16, vocab=64)
BATCH, DATASET = 4, 4096           # sequences per group per step; samples in the data set
LEARNING_RATE, MOMENTUM = 0.1, 0.9
# the job
GROUPS, STEPS, LATE_AT_STEP, FAIL_AT_STEP, DOWN_STEPS, EVERY = 3, 8, 2, 5, 2, 3
STATE_MB = [1, 48]                 # one run per size of the state a heal copies
STEPS_AFTER_RETURN = 4             # the job ends this long after the returned group trains
# torchft's timeouts, short: everything runs on one machine (their defaults in brackets)
HEARTBEAT_INTERVAL_MS = 100        # a group's beat to the lighthouse [100 ms]
HEARTBEAT_TIMEOUT_MS = 1000        # no beat for this long: the group is dead [5 s]
JOIN_TIMEOUT_MS = 600              # how long a quorum waits for stragglers [60 s]: above a
                                   # step with a heal's copy, which delays the sender's step
QUORUM_TICK_MS = 10                # how often the lighthouse decides [100 ms]
COLLECTIVE_TIMEOUT_S = 5           # all-reduce, should_commit, a heal's copy [60 s]
QUORUM_TIMEOUT_S = 10              # a group waiting for a quorum [60 s]
CONNECT_TIMEOUT_S = 5              # reaching the lighthouse or a peer's manager [60 s]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One start of one replica group."""
    group: int
    start: int = 0                 # 0 the first, 1 its first return, ...
    policy: str = "live"           # live: torchft heals; restart: checkpoint-restart
    kill_at: int = None            # kill itself at this step, once every group trains
    die_in_heal: bool = False      # kill itself as its heal begins
    resume_from: str = None        # a checkpoint to load first (restart)


def use_loopback():
    """gloo's sockets on the loopback interface (by default it takes the address the host's
    name resolves to), for the processes this lab starts on one machine."""
    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback[0]


def loopback_store():
    """A TCPStore for this group, as torchrun's agent hosts one, listening on 127.0.0.1
    alone (TCPStore binds every address when it opens its own socket)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return dist.TCPStore("127.0.0.1", listener.getsockname()[1], 1, is_master=True,
                         wait_for_workers=False, master_listen_fd=listener.detach(),
                         use_libuv=False)


def manager_server_on(host):
    """torchft 0.2's Manager starts its server on every address of the machine, with no
    option to choose (manager.py: bind = f"[::]:{port}"): when the group advertises an IPv4
    address (--hostname, 127.0.0.1 by default), its Managers start it on that address
    alone, on the port torchft chose (TORCHFT_MANAGER_PORT, or one of the OS's). A name is
    left to torchft: the address it has on this host (127.0.1.1 on many Debian hosts) need
    not be the one the other nodes reach, and a group healing from this one would be
    refused."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return
    if address.version != 4:
        return
    import torchft.manager
    start_server = torchft.manager.ManagerServer

    def on_host(*, bind, **options):
        return start_server(bind=f"{address}:{bind.rsplit(':', 1)[1]}", **options)

    torchft.manager.ManagerServer = on_host


def tensor_bytes(state):
    """Bytes of the tensors in a state, as PGTransport sends them (whole storages)."""
    return sum(t.untyped_storage().nbytes() for t in tree_leaves(state)
               if isinstance(t, torch.Tensor))


class TimedTransport(PGTransport):
    """torchft's heal over the process group, counting the bytes and timing the copy; with
    die_in_heal, the group kills itself as a heal it receives begins."""

    def __init__(self, pg, timeout, device, emit, die_in_heal):
        super().__init__(pg, timeout=timeout, device=device)
        self.emit, self.die_in_heal = emit, die_in_heal

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
        started = time.monotonic()
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)
        self.emit("sent", step=step, bytes=tensor_bytes(state_dict),
                  seconds=time.monotonic() - started)

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        if self.die_in_heal:
            self.emit("die", step=step, during="heal")
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.emit("healed", step=step, bytes=tensor_bytes(state), tensors=sum(
            isinstance(t, torch.Tensor) for t in tree_leaves(state)),
            seconds=time.monotonic() - started)
        return state


def timed_process_group(backend, timeout, emit):
    """torchft's process group for `backend`, timing each rebuild (configure, at every new
    quorum id): when it began, right after the lighthouse's answer came back, and how long
    the new communicators took."""
    base = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo

    class TimedRebuild(base):
        def configure(self, *args, **kwargs):
            started = time.monotonic()
            super().configure(*args, **kwargs)
            emit("configured", started=started, seconds=time.monotonic() - started)

    return TimedRebuild(timeout=timeout)


def reason(error):
    """The words of a torchft error that say why, without its Rust side's wrapping."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    said = re.search(r'message: "([^"]*)"', text)
    return said.group(1) if said else text.split(": ")[-1]


def sample_batch(shape, ids, seed, device):
    """Inputs and targets of the samples `ids`: each sample's tokens from its own seed."""
    rows = [torch.randint(shape.vocab, (shape.seq + 1,), device="cpu",
                          generator=distenv.generator(seed, "sample", i)) for i in ids]
    tokens = torch.stack(rows).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train_group(args, spec, env, end, emit, store_addr, store_port, folder):
    """One replica group's training loop, one rank, until step end[0]."""
    shape = shape_from_args(args)
    # the groups that start the job draw the same weights from its seed (init_sync=False:
    # torchft's step-0 sync would zero one group's first gradient yet count it in the
    # average); a group started later draws its own, and only a heal makes them the job's
    first = spec.start == 0 and spec.group != args.late_group
    torch.manual_seed(distenv.derived_seed(args.seed, "init", *(() if first else (
        spec.group, spec.start))))
    model = Transformer(shape, device=env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    held = {"payload": torch.zeros(args.payload_bytes // 4, device=env.device),
            "data": {"position": 0}}

    def state():
        return {"model": model.state_dict(), "optim": optimizer.state_dict(),
                "data": dict(held["data"]), "payload": held["payload"]}

    def load(saved):
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        held.update(data=dict(saved["data"]), payload=saved["payload"].to(env.device))

    timeout = datetime.timedelta(seconds=args.collective_timeout)
    pg = timed_process_group(env.backend, timeout, emit)
    manager_server_on(args.hostname)
    try:
        manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=load, state_dict=state,
            replica_id=f"group{spec.group}", timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout),
            connect_timeout=datetime.timedelta(seconds=args.connect_timeout),
            store_addr=store_addr, store_port=store_port, rank=0, world_size=1,
            lighthouse_addr=args.lighthouse, hostname=args.hostname, init_sync=False,
            heartbeat_interval=datetime.timedelta(milliseconds=args.heartbeat_interval_ms),
            checkpoint_transport=TimedTransport(pg, timeout, env.device, emit, spec.die_in_heal))
    except RuntimeError as error:
        raise LabError(f"group {spec.group}: the lighthouse at {args.lighthouse} did not "
                       f"answer within --connect-timeout {args.connect_timeout:g} s "
                       f"({reason(error)})") from None
    if spec.resume_from:
        saved = torch.load(spec.resume_from, weights_only=False)
        load(saved["user"])
        manager.load_state_dict(saved["torchft"])
        emit("resumed", step=manager.current_step())
    # torchft's own sampler: this group's shard of the data set, drawn in order
    with torch.device("cpu"):
        shard = list(DistributedSampler(range(DATASET), replica_rank=spec.group,
                                        num_replica_groups=args.groups, group_rank=0,
                                        num_replicas=1, shuffle=True, seed=args.seed))
    drawn, full_job = 0, False
    emit("ready")
    while manager.current_step() < end[0]:
        while end[1]:   # held between two steps while a group starts (the orchestrator's)
            time.sleep(0.002)
        step, started = manager.current_step(), time.monotonic()
        optimizer.zero_grad()
        manager.start_quorum()
        try:
            manager.wait_quorum()
        except Exception as error:   # noqa: BLE001  (torchft raises its Rust side's errors)
            raise LabError(f"group {spec.group}: no quorum of --min-replicas "
                           f"{args.min_replicas} within --quorum-timeout "
                           f"{args.quorum_timeout:g} s ({reason(error)})") from None
        quorum_t = time.monotonic()
        rank, participants = manager.participating_rank(), manager.num_participants()
        contributes = manager.is_participating()   # a healing group's gradient is zeroed
        # participant i of n trains the next batch of the global order after i batches; a
        # group being healed trains nothing this step (its gradient is zeroed)
        first, _ = ftm.participant_positions(held["data"]["position"], rank or 0,
                                             max(participants, 1), BATCH)
        ids = ftm.global_order(args.seed, DATASET, first, BATCH)
        sampler_ids, drawn = shard[drawn:drawn + BATCH], drawn + BATCH
        if spec.kill_at is not None and step >= spec.kill_at and full_job:
            emit("die", step=step, sampler_ids=sampler_ids)
            os.kill(os.getpid(), signal.SIGKILL)   # no clean-up, no word to the others
        inputs, targets = sample_batch(shape, ids, args.seed, env.device)
        next_token_loss(model(inputs), targets).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        committed = manager.should_commit()
        if committed and step == 0 and (spec.group, spec.start, spec.policy) == (0, 0, "live"):
            # the job's first weights, where the replay starts
            path = Path(folder) / "initial.pt"
            torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]).cpu(), path)
            emit("initial", params=str(path))
        if committed:
            optimizer.step()
            held["data"]["position"] += participants * BATCH
            full_job = participants == args.groups   # the kill waits for a step of all
        emit("attempt", step=step, participants=participants, rank=rank, committed=committed,
             t=started, quorum_t=quorum_t, end_t=time.monotonic(),
             contributes=contributes, ids=ids if contributes else [],
             sampler_ids=sampler_ids)
        if committed and spec.policy == "restart" and spec.group == 0 and (
                manager.current_step() % args.every == 0):
            path = Path(folder) / "checkpoint.pt"
            torch.save({"user": state(), "torchft": manager.state_dict()}, f"{path}.tmp")
            os.replace(f"{path}.tmp", path)   # a kill mid-save leaves the last one whole
            emit("saved", step=manager.current_step())
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    path = Path(folder) / f"params-{spec.group}-{spec.start}.pt"
    torch.save(params, path)
    emit("done", step=manager.current_step(), params=str(path))
    manager.shutdown(wait=False)


class LabError(Exception):
    """What a group says went wrong, in one line: the lab ends with it."""


# ---------------------------------------------------------------- the orchestrator
class Job:
    """A lighthouse and the replica groups of one run, forked from this process; their
    events come back as JSON lines through one pipe."""

    def __init__(self, args, folder, min_replicas):
        self.args, self.folder = args, folder
        self.read_fd, self.write_fd = os.pipe()
        # shared with the groups: the last step, and whether to pause between two steps
        self.end = multiprocessing.RawArray("q", [1 << 40, 0])
        self.pids, self.buffer, self.max_step = {}, b"", 0
        self.lighthouse = self._fork(self._serve_lighthouse, min_replicas)
        self.url = f"http://127.0.0.1:{self.next_event(kind='lighthouse')['port']}"

    def _fork(self, target, *extra):
        pid = os.fork()
        if pid == 0:   # the child: its own exit, never this process's clean-up
            status = 1
            try:
                os.close(self.read_fd)
                target(*extra)
                status = 0
            except LabError as error:
                self._emit("error", message=str(error))
            except BaseException as error:   # noqa: BLE001
                self._emit("error", message=f"{type(error).__name__}: {error}".splitlines()[0])
            finally:
                os._exit(status)
        return pid

    def _emit(self, kind, **fields):
        line = json.dumps({"kind": kind, "t": time.monotonic(), **fields}) + "\n"
        os.write(self.write_fd, line.encode())

    def _serve_lighthouse(self, min_replicas):
        args = self.args
        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas,
                                  join_timeout_ms=args.join_timeout_ms,
                                  quorum_tick_ms=args.quorum_tick_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
        self._emit("lighthouse", port=int(server.address().rsplit(":", 1)[1]))
        signal.sigwait([signal.SIGTERM])
        server.shutdown()

    def start(self, spec, hold=False):
        """Fork one group, with the variables torchrun would set for its one rank; with
        `hold`, the others pause between two steps until it is ready."""
        self.end[1] = int(hold)
        def run():
            for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
                os.environ.pop(name, None)
            # distenv picks GPU LOCAL_RANK when there is one per group
            os.environ.update(LOCAL_RANK=str(spec.group), LOCAL_WORLD_SIZE=str(self.args.groups))
            use_loopback()
            self.args.lighthouse = self.url
            self.args.backend = self.args.backend_chosen   # said once, by the orchestrator
            with distenv.initialize(self.args) as env:
                store = loopback_store()
                train_group(self.args, spec, env, self.end,
                            lambda kind, **f: self._emit(kind, group=spec.group,
                                                         start=spec.start, **f),
                            "127.0.0.1", store.port, self.folder)
        self.pids[(spec.group, spec.start)] = self._fork(run)
        return time.monotonic()

    def next_event(self, kind=None):
        """The next event (of `kind`), or a one-line failure after --timeout without one."""
        while True:
            while b"\n" not in self.buffer:
                ready, _, _ = select.select([self.read_fd], [], [], self.args.timeout)
                if not ready:
                    self.close()
                    distenv.fail(f"no group made progress for --timeout {self.args.timeout:g} s")
                self.buffer += os.read(self.read_fd, 1 << 16)
            line, self.buffer = self.buffer.split(b"\n", 1)
            event = json.loads(line)
            if event["kind"] == "error":
                self.close()
                distenv.fail(event["message"], every_rank=False)
            self.max_step = max(self.max_step, event.get("step", 0))
            if event["kind"] == "ready":
                self.end[1] = 0
            if kind is None or event["kind"] == kind:
                return event

    def end_soon(self, after):
        """Every group stops at the same step, a few past any step seen so far."""
        self.end[0] = max(self.args.steps, self.max_step + after)

    def close(self):
        if self.read_fd is None:
            return
        for pid in [self.lighthouse, *self.pids.values()]:
            try:
                os.kill(pid, signal.SIGKILL if pid != self.lighthouse else signal.SIGTERM)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.read_fd)
        os.close(self.write_fd)
        self.read_fd = self.write_fd = None


def live_run(args, folder):
    """The job under torchft: the late group heals, the failing group dies, returns after
    --down-steps steps and heals (twice with --die-in-heal). The others wait between two
    steps while a group starts, so that it joins at a known step: a start takes longer
    here than many of the lab's steps. Every event the groups sent, and the starts."""
    job = Job(args, folder, args.min_replicas)
    if args.min_replicas > args.groups - 1:
        print(f"waiting for a quorum of --min-replicas {args.min_replicas} groups: "
              f"{args.groups - 1} start first, {args.groups} in all", flush=True)
    starts, events, deaths, returning = {}, [], [], None
    for g in range(args.groups):
        if g != args.late_group:
            kill = args.fail_at_step if g == args.fail_group else None
            starts[(g, 0)] = job.start(Spec(g, kill_at=kill))
    running, late = set(starts), (args.late_group, 0)
    while running:
        event = job.next_event()
        events.append(event)
        key = (event.get("group"), event.get("start"))
        if event["kind"] in ("die", "done"):
            running.discard(key)
        if event["kind"] == "die":
            deaths.append(event)
            returning = None
        if event["kind"] != "attempt" or not event["committed"]:
            continue
        if late not in starts and event["step"] + 1 >= args.late_at_step:
            starts[late] = job.start(Spec(args.late_group), hold=True)
            running.add(late)
        # the survivors' steps without it: it comes back after --down-steps of them
        without = {e["step"] for e in events if deaths and e["kind"] == "attempt"
                   and e["committed"] and e["t"] > deaths[-1]["t"]}
        if deaths and returning is None and len(without) >= args.down_steps:
            start = len(deaths)
            returning = (args.fail_group, start)
            starts[returning] = job.start(Spec(args.fail_group, start, die_in_heal=(
                args.die_in_heal and start == 1)), hold=True)
            running.add(returning)
        if key == returning and job.end[0] > 1 << 39:
            job.end_soon(STEPS_AFTER_RETURN)
    job.close()
    return events, starts


def restart_run(args, folder):
    """The same job under checkpoint-restart: group 0 saves every --every steps; the kill
    stops every group and the lighthouse, and all start again from the last checkpoint,
    as a job started afresh does (a lighthouse that outlived them would wait for the dead
    groups' heartbeats to expire first)."""
    job = Job(args, folder, args.groups)
    job.end[0] = args.steps
    starts, events = {}, []
    for g in range(args.groups):
        kill = args.fail_at_step if g == args.fail_group else None
        starts[(g, 0)] = job.start(Spec(g, policy="restart", kill_at=kill))
    running = set(starts)
    while running:
        event = job.next_event()
        events.append(event)
        if event["kind"] == "done":
            running.discard((event["group"], event["start"]))
        if event["kind"] == "die":   # what torchrun does: stop every rank, start them all
            job.close()
            job = Job(args, folder, args.groups)
            job.end[0] = args.steps
            saved = str(Path(folder) / "checkpoint.pt")
            for g in range(args.groups):
                starts[(g, 1)] = job.start(Spec(g, 1, policy="restart", resume_from=saved))
            running = {(g, 1) for g in range(args.groups)}
    job.close()
    return events, starts


def measure_link(args, size_bytes, repeats=3, tensors=64):
    """The copy a heal makes, timed on its own: two processes of a torchft process group
    send each other states through the same transport (PGTransport), one of `tensors`
    one-value tensors and one of a single tensor of `size_bytes`, `repeats` times each
    after a first that sets the connection up. {latency_s: [seconds per message of the
    small state], bandwidth_bytes_per_s: [of the large one, its 3 messages' latency
    taken off]}, as the receiver times them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    read_fd, write_fd = os.pipe()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                use_loopback()
                nccl = args.backend_chosen == "nccl"
                device = torch.device("cuda", rank) if nccl else torch.device("cpu")
                if nccl:
                    torch.cuda.set_device(device)
                store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], 2,
                                      is_master=rank == 0, use_libuv=False,
                                      master_listen_fd=listener.fileno() if rank == 0 else None,
                                      timeout=datetime.timedelta(seconds=args.timeout))
                timeout = datetime.timedelta(seconds=args.collective_timeout)
                pg = (ProcessGroupNCCL if nccl else ProcessGroupGloo)(timeout=timeout)
                pg.configure(f"127.0.0.1:{store.port}/link", "link", rank, 2)
                transport = PGTransport(pg, timeout=timeout, device=device)
                seconds = []
                for shape in [(tensors, 1)] * (repeats + 1) + [(1, size_bytes // 4)] * (repeats + 1):
                    state = [torch.zeros(shape[1], device=device) for _ in range(shape[0])]
                    pg.barrier().wait()
                    started = time.monotonic()
                    if rank == 0:
                        transport.send_checkpoint([1], 0, state, timeout)
                    else:
                        transport.recv_checkpoint(0, "", 0, timeout)
                    seconds.append(time.monotonic() - started)
                if rank == 1:
                    os.write(write_fd, json.dumps(seconds).encode())
                pg.barrier().wait()
                status = 0
            finally:
                os._exit(status)
        pids.append(pid)
    listener.close()
    os.close(write_fd)
    seconds = json.loads(os.read(read_fd, 1 << 16))
    os.close(read_fd)
    for pid in pids:
        os.waitpid(pid, 0)
    small, large = seconds[1:repeats + 1], seconds[repeats + 2:]
    latency = [s / (tensors + 2) for s in small]
    return {"latency_s": latency, "bandwidth_bytes_per_s": [
        size_bytes / max(s - 3 * statistics.median(latency), 1e-9) for s in large]}


# ---------------------------------------------------------------- what the runs show
def committed_steps(events):
    """{step: participants} of the job's committed steps."""
    return {e["step"]: e["participants"] for e in events
            if e["kind"] == "attempt" and e["committed"]}


def replay(args, events, initial_path, divide_by=None):
    """The committed steps trained again in this one process, from what the groups
    recorded: each step's participants and their batches, the gradients summed and divided
    by the participants (torchft's DYNAMIC mode) or by `divide_by` groups, SGD with
    momentum from the job's first weights. The parameters it ends on."""
    shape = shape_from_args(args)
    model = Transformer(shape, device=torch.device("cpu"))
    torch.nn.utils.vector_to_parameters(torch.load(initial_path), model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    steps = {}
    for e in events:
        if e["kind"] == "attempt" and e["committed"] and e["contributes"]:
            steps.setdefault(e["step"], (e["participants"], {}))[1][e["rank"]] = e["ids"]
    for step in sorted(steps):
        participants, batches = steps[step]
        total = 0
        for rank in sorted(batches):
            model.zero_grad()
            inputs, targets = sample_batch(shape, batches[rank], args.seed, torch.device("cpu"))
            next_token_loss(model(inputs), targets).backward()
            total = total + torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.nn.utils.vector_to_parameters(total / (divide_by or participants),
                                            [p.grad for p in model.parameters()])
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def replay_diffs(args, events):
    """Group 0's final parameters against the replays, averaged over the participants and
    over every group. Run once every group has been forked: a fork after this process has
    computed in torch's thread pool can hang in the pool's lock."""
    final = torch.load(next(e["params"] for e in events if e["kind"] == "done"
                            and e["group"] == 0))
    initial = next(e["params"] for e in events if e["kind"] == "initial")
    return {name: (replay(args, events, initial, divide_by) - final).abs().max().item()
            for name, divide_by in (("replay_param_max_diff", None),
                                    ("replay_fixed_param_max_diff", args.groups))}


def summarize_live(args, events, starts, link):
    """A live run's measurements, from its groups' events, beside their predictions."""
    attempts = [e for e in events if e["kind"] == "attempt"]
    death = next(e for e in events if e["kind"] == "die" and "during" not in e)
    steps = committed_steps(events)
    # the survivors: every start alive across the death
    survivors = {k for k, t in starts.items() if t < death["t"] and k[0] != death["group"]}
    mine = {k: [e for e in attempts if (e["group"], e["start"]) == k] for k in survivors}
    detect = next(e for e in attempts if (e["group"], e["start"]) in survivors
                  and e["committed"] and e["t"] > death["t"])
    # the survivors' first rebuild after the death: it began when the lighthouse's answer
    # came back (the decision), and took the new communicators' time (the rebuild)
    rebuild = [min((e for e in events if e["kind"] == "configured"
                    and (e["group"], e["start"]) == key and e["started"] > death["t"]),
                   key=lambda e: e["started"]) for key in survivors]
    decided_t = min(e["started"] for e in rebuild)
    rebuild_s = max(e["t"] for e in rebuild) - decided_t
    # when the last survivor asked for that quorum: its step in flight had failed
    asked_t = max(min((e["end_t"] for e in mine[key] if not e["committed"]
                       and e["t"] < death["t"] < e["end_t"]), default=death["t"])
                  for key in survivors)
    heals = []
    for e in events:
        if e["kind"] != "healed" or e["step"] == 0:   # step 0: torchft's first sync
            continue
        key = (e["group"], e["start"])
        first = next(a for a in attempts if (a["group"], a["start"]) == key and a["committed"])
        ready = next(r for r in events if r["kind"] == "ready" and
                     (r["group"], r["start"]) == key)
        heals.append({"group": e["group"], "start": e["start"],
                      "why": "late" if key == (args.late_group, 0) else "return",
                      "step": e["step"], "heal_s": first["end_t"] - starts[key],
                      "ready_s": ready["t"] - starts[key], "copy_s": e["seconds"],
                      "predicted_copy_s": ftm.heal_copy_s(
                          e["bytes"], e["tensors"], statistics.median(link["latency_s"]),
                          statistics.median(link["bandwidth_bytes_per_s"])),
                      "bytes": e["bytes"], "tensors": e["tensors"]})
    done = [e for e in events if e["kind"] == "done"]
    reference = torch.load(next(e["params"] for e in done if e["group"] == 0))
    diff = max((torch.load(e["params"]) - reference).abs().max().item() for e in done)
    # the data: what the committed steps trained, by the global order and by the sampler
    trained = [i for e in attempts if e["committed"] for i in e["ids"]]
    positions = sum(steps.values()) * BATCH
    by_sampler = [i for e in attempts if e["committed"] and e["contributes"]
                  for i in e["sampler_ids"]]
    drawn = {i for e in events if e["kind"] in ("attempt", "die") for i in e.get("sampler_ids", [])}
    shards = [len({i for e in attempts if e["committed"] and e["contributes"]
                   and e["group"] == g for i in e["sampler_ids"]}) for g in range(args.groups)]
    # a participant torchft counts while it heals moves the position by its batch and
    # trains nothing: the one way the global order skips (a group healing at the
    # quorum's highest step; torchft's own step-0 sync is one, which the lab turns off)
    zeroed = sum(1 for e in attempts if e["committed"] and e["rank"] is not None
                 and not e["contributes"])
    data = {"global_order": dict(zip(("skipped_samples", "repeated_samples"),
                                     ftm.skipped_and_repeated(trained, ftm.global_order(
                                         args.seed, DATASET, 0, positions))),
                                 predicted_skipped_samples=zeroed * BATCH),
            "torchft_sampler": dict(zip(("skipped_samples", "repeated_samples"),
                                        ftm.skipped_and_repeated(by_sampler, drawn)),
                                    shard_lag_samples=max(shards) - min(shards))}
    steady = [e for e in attempts if e["committed"] and e["participants"] == args.groups]
    step_s = statistics.median(e["end_t"] - e["t"] for e in steady)
    window = dict(zip(("join_timeout_s", "heartbeat_timeout_s", "heartbeat_interval_s",
                       "tick_s", "step_s", "min_replicas"),
                      (args.join_timeout_ms / 1e3, args.heartbeat_timeout_ms / 1e3,
                       args.heartbeat_interval_ms / 1e3, args.quorum_tick_ms / 1e3, step_s,
                       args.min_replicas)))
    shape = shape_from_args(args)
    parameters = memory_model.transformer_params(shape.layers, shape.hidden, shape.vocab,
                                                 shape.seq)
    return {"payload_bytes": args.payload_bytes,
            "state_bytes": heals[0]["bytes"] if heals else None,
            # SGD with momentum: one buffer per parameter, and the payload
            "predicted_state_bytes": ftm.state_bytes(parameters, 1,
                                                     other_bytes=args.payload_bytes),
            # the whole window, with the rebuild this run measured: from a step in flight
            # that fails at once to one that waits the collective timeout
            "detect_window_s": ftm.detection_window(
                args.groups - 1, **window, collective_timeout_s=args.collective_timeout,
                rebuild_s=rebuild_s),
            "asked_s": asked_t - death["t"],
            # the lighthouse's decision, once the last survivor had asked
            "decision_window_s": ftm.quorum_issued_s(
                asked_t - death["t"], args.groups - 1, *(window[k] for k in (
                    "join_timeout_s", "heartbeat_timeout_s", "heartbeat_interval_s"))),
            "predicted_steps_lost_by_survivors": 0, "predicted_healed_param_max_diff": 0.0,
            "replica_groups_per_step": [steps[s] for s in sorted(steps)],
            "killed_at_step": death["step"],
            "detect_s": detect["quorum_t"] - death["t"],
            "decision_s": decided_t - death["t"], "rebuild_s": rebuild_s,
            "step_spread_s": max(e["end_t"] - e["t"] for e in steady)
            - min(e["end_t"] - e["t"] for e in steady),
            "steps_lost_by_survivors": max(
                sum(e["committed"] for e in a) - len({e["step"] for e in a if e["committed"]})
                for a in mine.values()),
            "attempts_discarded": sum(not e["committed"] for a in mine.values() for e in a),
            # the step in flight, on every survivor (its own start killed in its heal aside)
            "predicted_attempts_discarded": len(survivors),
            "heals": heals,
            "heals_died": sum(e["kind"] == "die" and "during" in e for e in events),
            "healed_param_max_diff": diff,
            "step_s": step_s,
            "quorum_s": statistics.median(e["quorum_t"] - e["t"] for e in steady),
            "data_while_out": data}


def summarize_restart(args, events):
    """The checkpoint-restart run: what it saved, lost and took to come back."""
    death = next(e for e in events if e["kind"] == "die")
    resumed = {e["step"] for e in events if e["kind"] == "resumed"}
    first = min(e["end_t"] for e in events
                if e["kind"] == "attempt" and e["start"] == 1 and e["committed"])
    return {"every": args.every, "saved_steps": [e["step"] for e in events if e["kind"] == "saved"],
            "killed_at_step": death["step"], "resumed_from_step": min(resumed),
            "steps_lost": death["step"] - min(resumed),
            # the work thrown away, in steps of one group: every group's steps since the
            # save, and the step in flight of the others, which the restart stops mid-step
            "group_steps_lost": (death["step"] - min(resumed)) * args.groups + args.groups - 1,
            "predicted_steps_lost": death["step"] % args.every,
            "restart_s": first - death["t"]}


def orchestrate(args):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, reason = distenv.choose_backend(args.backend, args.groups, gpus)
    if reason:
        print(reason, flush=True)
    args.backend_chosen = backend
    env = distenv.DistEnv(0, 1, 0, 1, backend, torch.device("cuda", 0) if backend == "nccl"
                          else torch.device("cpu"))
    runs = []
    with tempfile.TemporaryDirectory(prefix="fault-tolerance-") as folder:
        link = measure_link(args, max(int(max(args.state_mb) * 1e6) // 4 * 4, 4))
        for mb in args.state_mb:
            args.payload_bytes = int(mb * 1e6) // 4 * 4
            run_folder = Path(folder) / f"live-{mb}"
            run_folder.mkdir()
            events, starts = live_run(args, run_folder)
            runs.append(summarize_live(args, events, starts, link))
            runs[-1].update(payload_mb=mb, events=events)
        restart = None
        if args.checkpoint_restart:
            args.payload_bytes = int(args.state_mb[0] * 1e6) // 4 * 4
            run_folder = Path(folder) / "restart"
            run_folder.mkdir()
            restart = summarize_restart(args, restart_run(args, run_folder)[0])
        for run in runs:   # the last forks are done
            run.update(replay_diffs(args, run.pop("events")))
    heal_s = {}
    for run in runs:
        for heal in run["heals"]:
            heal_s.setdefault(heal["bytes"], []).append(heal["heal_s"])
    slowest = max(run["step_s"] for run in runs)
    copy = max(h["copy_s"] for run in runs for h in run["heals"]) if runs[0]["heals"] else 0.0
    timeouts = {name: getattr(args, name) for name in (
        "heartbeat_interval_ms", "heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms",
        "collective_timeout", "quorum_timeout", "connect_timeout", "timeout")}
    rules = ftm.timeout_rules(slowest, copy, args.collective_timeout,
                              args.heartbeat_interval_ms / 1e3, args.heartbeat_timeout_ms / 1e3,
                              args.join_timeout_ms / 1e3, args.quorum_timeout, args.timeout)
    first = runs[0]
    metrics = {"groups": args.groups, "min_replicas": args.min_replicas, "runs": runs,
               "replica_groups_per_step": first["replica_groups_per_step"],
               "detect_s": first["detect_s"],
               "steps_lost_by_survivors": max(r["steps_lost_by_survivors"] for r in runs),
               "healed_param_max_diff": max(r["healed_param_max_diff"] for r in runs),
               "heal_s": {str(k): v for k, v in heal_s.items()},
               "link": link, "checkpoint_restart": restart,
               "import_s": IMPORT_S, "timeouts": timeouts,
               "rules_broken": ftm.broken_rules(rules)}
    # the options as given: not what the lab set on them for its groups
    given = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                  if k not in ("backend_chosen", "payload_bytes")})
    result = env.write_result(given, metrics)
    print(f"{args.groups} replica groups; group {args.fail_group} killed at step "
          f"{first['killed_at_step']}, left out {first['detect_s']:.2f} s later; the survivors "
          f"lost {result['steps_lost_by_survivors']} steps; heals "
          + ", ".join(f"{h['heal_s']:.2f} s ({h['why']}, {h['bytes'] / 1e6:.0f} MB)"
                      for r in runs for h in r["heals"])
          + f"; healed parameters off by {result['healed_param_max_diff']:.1e}", flush=True)
    if restart:
        print(f"checkpoint-restart: resumed from step {restart['resumed_from_step']}, "
              f"{restart['steps_lost']} steps trained again, back {restart['restart_s']:.2f} s "
              f"after the kill", flush=True)


def run_one_group(args):
    """--group: this process is one replica group (under its own torchrun)."""
    if args.lighthouse is None:
        distenv.fail("--group needs --lighthouse http://HOST:PORT, the lighthouse's address")
    events = []
    args.payload_bytes = int(args.state_mb[0] * 1e6) // 4 * 4
    with distenv.initialize(args) as env:
        if env.world_size != 1:
            distenv.fail("one rank per replica group: torchrun --nproc_per_node=1")
        # torchrun's store, which the Manager joins; a group started without one hosts its own
        store = None if "MASTER_PORT" in os.environ else loopback_store()
        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"]) if store is None else store.port
        with tempfile.TemporaryDirectory() as folder:
            try:
                train_group(args, Spec(args.group), env, [args.steps, 0],
                            lambda kind, **f: events.append(
                                {"kind": kind, "t": time.monotonic(), **f}),
                            address, port, folder)
            except LabError as error:
                distenv.fail(str(error), every_rank=False)
        del args.payload_bytes   # the lab's, not an option
        env.write_result(args, {"group": args.group, "attempts": [
            e for e in events if e["kind"] == "attempt"], "heals": [
            e for e in events if e["kind"] == "healed"]})


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--groups", type=distenv.at_least(2), default=GROUPS,
                        help="replica groups, one rank each")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS,
                        help="the fewest steps the job trains")
    parser.add_argument("--late-group", type=distenv.at_least(0), default=None,
                        help="the group that starts late (default: the last)")
    parser.add_argument("--late-at-step", type=distenv.at_least(1), default=LATE_AT_STEP)
    parser.add_argument("--fail-group", type=distenv.at_least(0), default=None,
                        help="the group killed (default: 1, or 0 when 1 is the late one)")
    parser.add_argument("--fail-at-step", type=distenv.at_least(0), default=FAIL_AT_STEP)
    parser.add_argument("--down-steps", type=distenv.at_least(1), default=DOWN_STEPS,
                        help="the survivors train this many steps before the group returns")
    parser.add_argument("--die-in-heal", action="store_true",
                        help="the group's first return is killed as its heal begins")
    parser.add_argument("--state-mb", type=distenv.int_list(0), default=STATE_MB,
                        metavar="MB[,MB...]", help="the payload a heal copies: a run per value")
    parser.add_argument("--min-replicas", type=distenv.positive_int, default=None,
                        help="groups a quorum needs (default: those that start first)")
    parser.add_argument("--checkpoint-restart", action=argparse.BooleanOptionalAction,
                        default=True, help="then the same job under checkpoint-restart")
    parser.add_argument("--every", type=distenv.positive_int, default=EVERY,
                        help="checkpoint-restart: a checkpoint every K steps")
    timing = parser.add_argument_group("torchft's timeouts")
    for name, default in (("heartbeat-interval-ms", HEARTBEAT_INTERVAL_MS),
                          ("heartbeat-timeout-ms", HEARTBEAT_TIMEOUT_MS),
                          ("join-timeout-ms", JOIN_TIMEOUT_MS),
                          ("quorum-tick-ms", QUORUM_TICK_MS)):
        timing.add_argument(f"--{name}", type=distenv.positive_int, default=default)
    for name, default in (("collective-timeout", COLLECTIVE_TIMEOUT_S),
                          ("quorum-timeout", QUORUM_TIMEOUT_S),
                          ("connect-timeout", CONNECT_TIMEOUT_S)):
        timing.add_argument(f"--{name}", type=distenv.number_above(0), default=default,
                            metavar="SECONDS")
    parser.add_argument("--group", type=distenv.at_least(0), default=None,
                        help="be this one replica group, under torchrun (a cluster)")
    parser.add_argument("--lighthouse", default=None, metavar="URL",
                        help="with --group: the lighthouse, http://HOST:PORT")
    parser.add_argument("--hostname", default="127.0.0.1",
                        help="the address this group's manager advertises")
    add_shape_args(parser, SHAPE)
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    shape_from_args(args)
    if args.late_group is None:
        args.late_group = args.groups - 1
    if args.fail_group is None:
        args.fail_group = 1 if args.late_group != 1 else 0
    if args.min_replicas is None:
        args.min_replicas = args.groups - 1
    for option in ("late_group", "fail_group"):
        if getattr(args, option) >= args.groups:
            distenv.fail(f"--{option.replace('_', '-')} {getattr(args, option)} is not one of "
                         f"--groups {args.groups} (0 to {args.groups - 1})")
    if args.late_group == args.fail_group:
        distenv.fail("--late-group and --fail-group must be two different groups")
    if args.group is None and args.fail_at_step >= args.steps:
        distenv.fail(f"--fail-at-step {args.fail_at_step} is past the last step "
                     f"({args.steps - 1}); raise --steps")
    return args


def main():
    args = parse_args()
    if args.group is not None:
        run_one_group(args)
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        distenv.fail("the lab starts its replica groups itself: run it as one process "
                     "(python, or torchrun --nproc_per_node=1)")
    orchestrate(args)


if __name__ == "__main__":
    main()
