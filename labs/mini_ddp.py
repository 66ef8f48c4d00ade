"""Data parallelism built three ways, then torch's own, trained on the same data and timed.

  naive       after backward, one all-reduce per parameter. Not used in practice, but
              every later idea fixes one of its costs: one latency per tensor, and no
              communication until the whole backward pass is over.
  bucketed    after backward, gradients copied into flat buckets that close at the
              tensor reaching --bucket-mb (DDP's grouping), one all-reduce per bucket:
              fewer, larger messages.
  overlapped  the same buckets, each all-reduced asynchronously as soon as backward has
              produced all its gradients, while backward goes on with earlier layers.
  torch_ddp   torch.nn.parallel.DistributedDataParallel with the same bucket cap.

All variants start from the same weights and train on the same shards of the same
batches; steps alternate between them, so a slow moment of the machine hits all alike.
At the end each is compared with one process that trained on the whole batch.

--comm-delay-ns-per-byte D slows the network down in software: each all-reduce first
waits D ns per byte a rank sends in a ring (2(N-1)/N times its size), one all-reduce at a
time on a communication thread of its own, in the scratch variants and (through a
communication hook) in torch DDP. The wait uses no CPU, so it can hide behind backward as
a transfer over a real network hides behind GPU compute; D = 1 is a 1 GB/s link. A list
(0,5) runs every variant over each link in the same launch, steps alternating.

Launch lines (from the repository root):
  laptop, gloo on CPU:   torchrun --standalone --nproc_per_node=2 labs/mini_ddp.py
  with a slow link:      torchrun --standalone --nproc_per_node=2 labs/mini_ddp.py \\
                           --comm-delay-ns-per-byte 5
  GPU box, NCCL:         torchrun --standalone --nproc_per_node=8 labs/mini_ddp.py --out ddp.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=mini_ddp labs/mini_ddp.py --out ddp.json

JSON: `links` [{comm_delay_ns_per_byte, variants {name: {step_time_s (median),
step_time_spread_s (upper minus lower quartile, timing.summary: below 8 timed steps the
slowest minus the fastest), max_param_diff (against the single-process reference)}}}], one
per delay; `bucket_bytes` (the scratch buckets, in all-reduce order), `param_bytes` (one per
parameter, same order), `torch_ddp_bucket_bytes` and `torch_ddp_first_bucket_bytes` (torch
DDP's own buckets after its rebuild and in its first iteration, read from its logging data;
null without the torch_ddp variant), and the compute of one step without communication:
`forward_time_s`, `backward_time_s`, `optimizer_time_s`.
"""

import argparse
import concurrent.futures
import copy
import time

import torch
import torch.distributed as dist

from labkit.runtime import distenv, timing
from labkit.predict import time_model
from labkit.parallel.strategies import SCALING_SHAPE as SHAPE
from labkit.parallel.strategies import TorchDDP, rank_batch, train_step
from labkit.model.transformer import Transformer, next_token_loss

# model and data: SCALING_SHAPE, 2.14 MB of fp32 gradients, in two buckets at a 1 MiB cap
# (a bucket closes at the tensor that takes it to the cap, so each holds a little more)
BATCH = 4              # sequences per rank per step
LEARNING_RATE = 0.1    # plain SGD: the result depends on the gradients alone
# timing
STEPS = 14             # training steps of every variant
WARMUP = 2             # first steps left out of the timing (allocation, DDP's bucket rebuild)
BUCKET_MB = 1.0        # bucket cap of the scratch variants and of DDP
VARIANTS = ("naive", "bucketed", "overlapped", "torch_ddp")


class Link:
    """Where every all-reduce of the lab goes. all_reduce(t) sums t over the ranks in place
    and returns a torch Future; with a delay, the all-reduces queue on one thread and each
    first waits its delay (time.sleep, which releases the CPU), like transfers on a link."""

    def __init__(self, world_size, ns_per_byte):
        self.world_size, self.ns_per_byte = world_size, ns_per_byte
        self.thread = concurrent.futures.ThreadPoolExecutor(1) if ns_per_byte > 0 else None

    def all_reduce(self, tensor):
        if self.thread is None:
            return dist.all_reduce(tensor, async_op=True).get_future()
        future = torch.futures.Future()
        self.thread.submit(self._transfer, tensor, future)
        return future

    def _transfer(self, tensor, future):
        try:
            if tensor.is_cuda:
                # a thread starts on cuda:0 whatever the main thread chose: NCCL calls
                # made from it must run on the rank's own GPU
                torch.cuda.set_device(tensor.device)
            size = tensor.numel() * tensor.element_size()
            time.sleep(time_model.delay_s(size, self.world_size, self.ns_per_byte))
            dist.all_reduce(tensor)
            future.set_result([tensor])
        except Exception as error:  # hand it to whoever waits, instead of hanging them
            future.set_exception(error)

    def close(self):
        if self.thread is not None:
            self.thread.shutdown()


class Bucket:
    """A flat buffer for the gradients of a few parameters, all-reduced as one message."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.empty(sum(p.numel() for p in params), device=params[0].device)
        self.views = list(self.buffer.split([p.numel() for p in params]))

    def pack(self):
        for view, param in zip(self.views, self.params):
            view.copy_(param.grad.view(-1))

    def unpack(self, scale):
        self.buffer.mul_(scale)
        for view, param in zip(self.views, self.params):
            param.grad.copy_(view.view_as(param.grad))


def sgd(params):
    """Plain SGD: the result depends on the gradients alone."""
    return torch.optim.SGD(params, lr=LEARNING_RATE)


class Naive:
    def __init__(self, model, link, bucket_bytes_cap):
        self.model, self.link = model, link
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = sgd(self.params)

    def train_step(self, ids, targets):
        train_step(self.model, self.optimizer, ids, targets, self.after_backward)

    def after_backward(self):
        for param in self.params:
            self.link.all_reduce(param.grad).wait()
            param.grad.div_(self.link.world_size)


class Bucketed(Naive):
    def __init__(self, model, link, bucket_bytes_cap):
        super().__init__(model, link, bucket_bytes_cap)
        # Last parameter first: the order backward produces gradients, as DDP does.
        ready_order = self.params[::-1]
        sizes = [p.numel() * p.element_size() for p in ready_order]
        layout = time_model.bucket_layout(sizes, (bucket_bytes_cap, bucket_bytes_cap))
        self.buckets = [Bucket([ready_order[i] for i in indices]) for indices in layout]

    def after_backward(self):
        for bucket in self.buckets:
            bucket.pack()
            self.link.all_reduce(bucket.buffer).wait()
            bucket.unpack(1.0 / self.link.world_size)


class Overlapped(Bucketed):
    def __init__(self, model, link, bucket_bytes_cap):
        super().__init__(model, link, bucket_bytes_cap)
        self.bucket_of = {param: i for i, b in enumerate(self.buckets) for param in b.params}
        self._reset()
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)

    def _reset(self):
        self.missing = [len(bucket.params) for bucket in self.buckets]
        self.futures, self.launched = [], 0

    def _gradient_ready(self, param):
        """Runs inside backward. Buckets are launched in index order, whatever order their
        gradients arrive in, so every rank issues the same all-reduces in the same order."""
        self.missing[self.bucket_of[param]] -= 1
        while self.launched < len(self.buckets) and self.missing[self.launched] == 0:
            bucket = self.buckets[self.launched]
            bucket.pack()
            self.futures.append(self.link.all_reduce(bucket.buffer))
            self.launched += 1

    def after_backward(self):
        if self.launched != len(self.buckets):
            raise RuntimeError("backward did not produce every gradient (an unused parameter?)")
        for bucket, future in zip(self.buckets, self.futures):
            future.wait()
            bucket.unpack(1.0 / self.link.world_size)
        self._reset()


def torch_ddp(model, link, bucket_bytes_cap):
    """torch DDP with the same bucket cap, over the same link (slowed by a hook if it is)."""
    delayed = link.thread is not None
    return TorchDDP(model, next(model.parameters()).device, sgd,
                    comm_hook=delayed_allreduce_hook if delayed else None, hook_state=link,
                    bucket_cap_mb=bucket_bytes_cap / 2**20)


def delayed_allreduce_hook(link, bucket):
    """DDP communication hook: average one bucket through the slow link."""
    buffer = bucket.buffer().div_(link.world_size)
    return link.all_reduce(buffer).then(lambda future: future.value()[0])


IMPLEMENTATIONS = {"naive": Naive, "bucketed": Bucketed, "overlapped": Overlapped,
                   "torch_ddp": torch_ddp}


def batch(args, step, rank, device):
    return rank_batch(SHAPE, args.batch, args.seed, step, rank, device)


def torch_ddp_buckets(ddp):
    """(bytes of each bucket after DDP's rebuild, in all-reduce order; bytes of each bucket
    of its first iteration), as torch's DDP logs them (_get_ddp_logging_data: comma-separated
    strings). The rebuilt sizes exist once DDP has rebuilt, after its first iteration."""
    logged = ddp._get_ddp_logging_data()

    def sizes(key):
        text = logged.get(key)
        return [int(part) for part in text.split(",")] if text else None
    return sizes("rebuilt_bucket_sizes"), sizes("bucket_sizes")


def reference_params(initial, args, env):
    """One process, the whole batch (all ranks' shards) at every step."""
    model = copy.deepcopy(initial)
    optimizer = sgd(model.parameters())
    for step in range(args.steps):
        shards = [batch(args, step, r, env.device) for r in range(env.world_size)]
        ids, targets = (torch.cat(parts) for parts in zip(*shards))
        train_step(model, optimizer, ids, targets)
    return list(model.parameters())


def run(args, env):
    torch.manual_seed(args.seed)
    initial = Transformer(SHAPE, device=env.device)
    cap = int(args.bucket_mb * 2**20)
    links = [Link(env.world_size, delay) for delay in args.comm_delay_ns_per_byte]
    runs = {}   # (link index, variant) -> (implementation, step times)
    for index, link in enumerate(links):
        for name in args.variants:
            runs[index, name] = (IMPLEMENTATIONS[name](copy.deepcopy(initial), link, cap), [])
    for step in range(args.steps):
        ids, targets = batch(args, step, env.rank, env.device)
        for implementation, times in runs.values():
            elapsed = timing.timed(env.device, lambda: implementation.train_step(ids, targets))
            if step >= args.warmup:
                times.append(elapsed)
        env.progress(f"step {step + 1}/{args.steps}")
    env.progress("")
    for link in links:
        link.close()

    reference = reference_params(initial, args, env)
    results = [{"comm_delay_ns_per_byte": link.ns_per_byte, "variants": {}} for link in links]
    for (index, name), (implementation, times) in runs.items():
        median, low, high = timing.summary(times)
        results[index]["variants"][name] = {
            "step_time_s": median, "step_time_spread_s": high - low,
            "max_param_diff": distenv.max_param_diff(implementation.model.parameters(),
                                                     reference, env.device)}
    params = list(initial.parameters())[::-1]
    sizes = [p.numel() * p.element_size() for p in params]
    # torch DDP's own buckets, to check the scratch ones against (the first link's run)
    ddp = runs.get((0, "torch_ddp"))
    rebuilt, first = torch_ddp_buckets(ddp[0].model) if ddp else (None, None)
    metrics = {"links": results, "param_bytes": sizes,
               "bucket_bytes": time_model.bucket_bytes(sizes, (cap, cap)),
               "torch_ddp_bucket_bytes": rebuilt, "torch_ddp_first_bucket_bytes": first}

    model = copy.deepcopy(initial)
    optimizer = sgd(model.parameters())
    ids, targets = batch(args, 0, env.rank, env.device)
    compute = timing.compute_times(model, optimizer, next_token_loss, ids, targets, env.device,
                                   repeats=args.steps - args.warmup)
    metrics.update({f"{phase[:-2]}_time_s": seconds for phase, seconds in compute.items()})
    return metrics


def delays(text):
    """--comm-delay-ns-per-byte: comma-separated, each >= 0."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"cannot be negative, got {text}")
    return values


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--variants", type=distenv.choice_list(VARIANTS), default=list(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}; or all")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS,
                        help="training steps per variant")
    parser.add_argument("--warmup", type=distenv.at_least(0), default=WARMUP,
                        help="first steps not timed")
    parser.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                        help="sequences per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB,
                        help="bucket cap in MiB (scratch buckets and DDP's bucket_cap_mb)")
    parser.add_argument("--comm-delay-ns-per-byte", type=delays, default=[0.0],
                        help="extra wait per byte a rank sends, in ns (1 = a 1 GB/s link); "
                             "a comma-separated list runs each")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        distenv.fail(f"--warmup must be at least 0 and less than --steps ({args.steps}), "
                     f"got {args.warmup}")
    if args.bucket_mb <= 0:
        distenv.fail(f"--bucket-mb must be positive, got {args.bucket_mb:g}")
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        metrics = run(args, env)
        env.print0(f"world size {env.world_size} ({env.backend}), buckets of "
                   f"{', '.join(f'{b:,}' for b in metrics['bucket_bytes'])} bytes (cap "
                   f"{args.bucket_mb:g} MiB: a bucket closes at the tensor that reaches it)")
        if metrics["torch_ddp_bucket_bytes"] is not None:
            env.print0(f"torch DDP's buckets: {metrics['torch_ddp_bucket_bytes']} after its "
                       f"rebuild, {metrics['torch_ddp_first_bucket_bytes']} in its first "
                       f"iteration")
        for link in metrics["links"]:
            env.print0(f"comm delay {link['comm_delay_ns_per_byte']:g} ns/byte:")
            env.print0(f"{'variant':>11} {'step ms':>9} {'IQR ms':>8} {'max |p - ref|':>14}")
            for name, row in link["variants"].items():
                env.print0(f"{name:>11} {row['step_time_s'] * 1e3:>9.2f} "
                           f"{row['step_time_spread_s'] * 1e3:>8.2f} "
                           f"{row['max_param_diff']:>14.2e}")
        env.print0(f"compute alone: forward {metrics['forward_time_s'] * 1e3:.2f} ms, backward "
                   f"{metrics['backward_time_s'] * 1e3:.2f} ms, optimizer "
                   f"{metrics['optimizer_time_s'] * 1e3:.2f} ms")
        env.write_result(args, metrics)


if __name__ == "__main__":
    main()
