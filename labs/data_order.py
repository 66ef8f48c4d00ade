"""The data order across a restart and a resize: which samples a data-parallel job skips
or trains twice when it resumes at the same, a smaller or a larger world size, for three
ways of ordering the data.

  distributed_sampler   torch's DistributedSampler (shuffled per epoch, seeded): rank r of
                        N takes positions r, r + N, ... of the epoch's order; the resume
                        skips the batches each rank trained, as a plain DataLoader must
  stateful_dataloader   torchdata's StatefulDataLoader over the same sampler, with worker
                        processes: each rank saves the loader's state_dict and loads its
                        own; a rank that had none (the world grew) starts the epoch afresh
  global_order          one seeded order of the whole data set, epoch after epoch
                        (labkit.predict.fault_tolerance_model.global_order): rank r of N
                        trains the r-th batch after the position, the position moves N b a
                        step, and the checkpoint keeps it

For each pair in --resizes (the world size saved at, then resumed at), each design trains
--save-at steps, saves, resumes at the second size and trains to the end of the epoch.
Over the epoch the lab counts the samples never trained (skipped) and the trainings beyond
a sample's first (repeated); at an unchanged size it compares the resumed run's batches with
those of a run that never stopped, bit for bit. What a rank trains depends only on its
rank, the world size and the state it loaded, so the lab plays the ranks of each world in
turn (over the launch's processes when there are several); the loaders' workers are real.

Launch lines (from the repository root):
  laptop:        python labs/data_order.py --out order.json
  any launcher:  torchrun --standalone --nproc_per_node=4 labs/data_order.py   (the same
                 counts, the ranks shared out between the processes)

JSON: `designs` {name: {bit_identical_resume (at an unchanged size), skipped_samples and
repeated_samples (totals over the resizes), resizes: [{from, to, skipped_samples,
repeated_samples, bit_identical_resume (null when the size changed),
predicted_skipped_samples and predicted_repeated_samples (fault_tolerance_model's
sampler_resume_error, stateful_resume_error; 0 for the global order)}]}},
`dataset`, `batch`, `save_at`, `workers`.
"""

import itertools
import multiprocessing
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from labkit.predict import fault_tolerance_model as ftm
from labkit.runtime import distenv

DATASET, BATCH, FEATURES = 240, 4, 8   # 240: whole batches at 2, 3 and 4 ranks
SAVE_AT = 5                            # steps trained before the checkpoint
RESIZES = "3:3,4:3,2:3"                # save at, resume at: unchanged, down, up (3 is odd)
WORKERS = 2                            # the stateful loader's worker processes
# forked, DataLoader's default on Linux, whatever start method the caller set (a test
# runner's forkserver would start each worker as a fresh interpreter); elsewhere the default
WORKER_START = "fork" if sys.platform == "linux" else None
DESIGNS = ("distributed_sampler", "stateful_dataloader", "global_order")
# (skipped, repeated) of a resize, by the cost model: what each design's rule implies
PREDICTIONS = {"distributed_sampler": ftm.sampler_resume_error,
               "stateful_dataloader": ftm.stateful_resume_error,
               "global_order": lambda *sizes: (0, 0)}
# torchdata 0.11 calls a torch function that torch 2.13 deprecates: its warning, not the lab's
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


class Samples(Dataset):
    """Sample i: its id and features drawn from its own seed, made on the host."""

    def __init__(self, size, seed):
        self.size, self.seed = size, seed

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        features = torch.randn(FEATURES, generator=distenv.generator(self.seed, "sample", i),
                               device="cpu")
        return torch.tensor(i, device="cpu"), features


def sampler(dataset, world, rank, seed):
    return DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)


def loader_batches(design, dataset, world, rank, seed, steps=None, skip=0, state=None):
    """(batches, state): this rank's batches, `steps` of them (None: to the epoch's end),
    after skipping `skip` (distributed_sampler) or loading `state` (stateful_dataloader);
    the state to save after them (the stateful loader's state_dict)."""
    if design == "distributed_sampler":
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler(dataset, world, rank, seed))
        batches = itertools.islice(loader, skip, None if steps is None else skip + steps)
        return list(batches), None
    loader = StatefulDataLoader(dataset, batch_size=BATCH, num_workers=WORKERS,
                                sampler=sampler(dataset, world, rank, seed),
                                multiprocessing_context=multiprocessing.get_context(WORKER_START))
    if state is not None:
        loader.load_state_dict(state)
    batches = list(itertools.islice(loader, steps))
    return batches, loader.state_dict()


def global_batches(dataset, world, rank, seed, position, steps=None):
    """(batches, position): rank r's batches of the global order from `position`, `steps`
    of them (None: until every position of the epoch is taken), each (ids, features,
    positions), and where the order stands after them."""
    batches, step = [], 0
    while (position < len(dataset)) if steps is None else (step < steps):
        first, last = ftm.participant_positions(position, rank, world, BATCH)
        samples = [dataset[i] for i in ftm.global_order(seed, len(dataset), first, BATCH)]
        batches.append((torch.stack([s[0] for s in samples]),
                        torch.stack([s[1] for s in samples]),
                        torch.arange(first, last, device="cpu")))
        position, step = position + world * BATCH, step + 1
    return batches, position


def run_world(design, dataset, world, seed, env, steps=None, saved=None, skip=0):
    """Every rank of a world of `world`, played by the ranks of this launch in turn:
    {rank: batches}, {rank: state to save}, for the ranks this process played."""
    batches, states = {}, {}
    for rank in range(env.rank, world, env.world_size):
        if design == "global_order":
            position = saved if saved is not None else 0
            batches[rank], states[rank] = global_batches(dataset, world, rank, seed, position,
                                                         steps)
        else:
            state = (saved or {}).get(rank)
            batches[rank], states[rank] = loader_batches(design, dataset, world, rank, seed,
                                                         steps, skip, state)
    return batches, states


def gathered(env, mine):
    """Every process's dict of ranks, merged (an all_gather_object when there are several)."""
    parts = [None] * env.world_size
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def trained_ids(batches, epoch_size):
    """The sample ids in `batches` ({rank: [batch]}) that belong to the epoch: all of a
    loader's; of the global order's, those at positions before the epoch's end (the last
    step may run into the next epoch)."""
    return [i for rank_batches in batches.values() for batch in rank_batches
            for k, i in enumerate(batch[0].tolist())
            if len(batch) == 2 or batch[2][k] < epoch_size]


def resume(design, dataset, before, after, seed, env):
    """Save at `before` after SAVE_AT steps, resume at `after` to the epoch's end: the
    epoch's skipped and repeated samples, and whether the resumed batches equal those of a
    run at `after` that never stopped (at an unchanged size; None otherwise)."""
    first, states = run_world(design, dataset, before, seed, env, steps=SAVE_AT)
    states = gathered(env, states)
    saved = states[0] if design == "global_order" else states
    # the global order's saved position is the same for every rank
    rest, _ = run_world(design, dataset, after, seed, env, saved=saved, skip=SAVE_AT)
    first, rest = gathered(env, first), gathered(env, rest)
    trained = trained_ids(first, len(dataset)) + trained_ids(rest, len(dataset))
    skipped, repeated = ftm.skipped_and_repeated(trained, range(len(dataset)))
    identical = None
    if before == after:
        straight, _ = run_world(design, dataset, after, seed, env)
        straight = gathered(env, straight)
        identical = all(
            len(straight[r]) == SAVE_AT + len(rest[r]) and all(
                all(torch.equal(x, y) for x, y in zip(a, b))
                for a, b in zip(straight[r][SAVE_AT:], rest[r]))
            for r in range(after))
    return {"from": before, "to": after, "skipped_samples": skipped,
            "repeated_samples": repeated, "bit_identical_resume": identical}


def run(args, env):
    dataset = Samples(DATASET, args.seed)
    designs = {}
    with torch.device("cpu"):   # the data order lives on the host, wherever training runs
        for design in args.designs:
            resizes = [resume(design, dataset, a, b, args.seed, env) for a, b in args.resizes]
            for resize in resizes:   # each design's prediction, from positions alone
                skipped, repeated = PREDICTIONS[design](DATASET, BATCH, SAVE_AT,
                                                        resize["from"], resize["to"])
                resize.update(predicted_skipped_samples=skipped,
                              predicted_repeated_samples=repeated)
            same = [r["bit_identical_resume"] for r in resizes if r["from"] == r["to"]]
            designs[design] = {
                "bit_identical_resume": all(same) if same else None,
                "skipped_samples": sum(r["skipped_samples"] for r in resizes),
                "repeated_samples": sum(r["repeated_samples"] for r in resizes),
                "resizes": resizes}
    return {"designs": designs, "dataset": DATASET, "batch": BATCH, "save_at": SAVE_AT,
            "workers": WORKERS}


def resize_list(text):
    """--resizes: comma-separated SAVE:RESUME world sizes, each dividing the data set."""
    pairs = []
    for part in text.split(","):
        sizes = part.split(":")
        if len(sizes) != 2 or not all(s.isdigit() and int(s) >= 1 for s in sizes):
            distenv.fail(f"--resizes {part!r}: expected two world sizes, as in 4:3")
        pairs.append(tuple(int(s) for s in sizes))
    for size in {s for pair in pairs for s in pair}:
        if DATASET % (size * BATCH) or size * SAVE_AT * BATCH > DATASET:
            distenv.fail(f"--resizes: a world of {size} does not split the {DATASET} samples "
                         f"into whole batches of {BATCH} with {SAVE_AT} steps to save after")
    return pairs


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--resizes", default=RESIZES, metavar="N:M[,N:M...]",
                        help="world sizes to save at and to resume at")
    parser.add_argument("--designs", type=distenv.choice_list(DESIGNS), default=list(DESIGNS),
                        metavar="NAME[,NAME...]", help=f"from {', '.join(DESIGNS)}, or all")
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    args.resizes = resize_list(args.resizes)
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        result = env.write_result(args, run(args, env))
        if result is not None:
            for name, design in result["designs"].items():
                env.print0(f"{name:20} " + "; ".join(
                    f"{r['from']} -> {r['to']}: {r['skipped_samples']} skipped, "
                    f"{r['repeated_samples']} repeated" for r in design["resizes"])
                    + f"; resumed bit for bit: {design['bit_identical_resume']}")


if __name__ == "__main__":
    main()
