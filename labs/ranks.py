"""Where each rank landed: the names torchrun gives the processes of a job.

torchrun starts one agent per node; the agents meet in a rendezvous, which numbers the
nodes (GROUP_RANK), and each agent starts --nproc_per_node workers on its node. Every
worker finds its place in environment variables: RANK (in the whole job), LOCAL_RANK (on
its node, which picks its GPU), GROUP_RANK (its node), WORLD_SIZE, LOCAL_WORLD_SIZE, and
MASTER_ADDR/MASTER_PORT (where the process group's store is). Each rank reports these,
its host, its process id and its agent's; rank 0 gathers them and checks that they fit:
every rank from 0 to WORLD_SIZE - 1 once, numbered node after node (RANK = the ranks of
the nodes before + LOCAL_RANK), and one agent per node.

Launch lines (from the repository root):
  laptop, gloo on CPU:   torchrun --standalone --nproc_per_node=4 labs/ranks.py
  two nodes, c10d rendezvous (the same line on each node; HOST: any one node's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 --rdzv-id=job42 labs/ranks.py
  two nodes, static (K = 0 on HOST, 1 on the other):
    torchrun --nnodes=2 --node-rank=K --nproc_per_node=8 --master-addr=HOST \\
             --master-port=29500 labs/ranks.py

JSON: `ranks` (one entry per rank, in rank order: rank, local_rank, group_rank,
local_world_size, host, pid, agent_pid, master_addr, master_port, restart_count),
`nodes` (how many distinct GROUP_RANKs).
"""

import os
import socket

import torch.distributed as dist

from labkit.runtime import distenv


def this_rank(env):
    """What this process was told by its agent, and where it runs."""
    return {"rank": env.rank, "local_rank": env.local_rank,
            "group_rank": int(os.environ.get("GROUP_RANK", 0)),
            "local_world_size": env.local_world_size,
            "host": socket.gethostname(), "pid": os.getpid(), "agent_pid": os.getppid(),
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT"),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}


def layout_problems(ranks):
    """What does not fit in the gathered layout (empty if all is well)."""
    problems = []
    if sorted(r["rank"] for r in ranks) != list(range(len(ranks))):
        problems.append("the ranks are not 0 .. WORLD_SIZE - 1, once each")
    nodes = sorted({r["group_rank"] for r in ranks})
    first_rank = {}   # node -> its first global rank: the sizes of the nodes before it
    for node in nodes:
        first_rank[node] = sum(r["local_world_size"] for r in ranks
                               if r["group_rank"] < node and r["local_rank"] == 0)
    for r in ranks:
        if r["rank"] != first_rank[r["group_rank"]] + r["local_rank"]:
            problems.append(f"rank {r['rank']} is not node {r['group_rank']}'s first rank "
                            f"+ local rank {r['local_rank']}")
    agents = {node: {r["agent_pid"] for r in ranks if r["group_rank"] == node}
              for node in nodes}
    if any(len(pids) != 1 for pids in agents.values()):
        problems.append("a node's ranks were not started by one agent")
    return problems


def run(env):
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, this_rank(env))
    ranks.sort(key=lambda r: r["rank"])
    problems = layout_problems(ranks)
    if problems:
        distenv.fail("; ".join(problems))
    return {"ranks": ranks, "nodes": len({r["group_rank"] for r in ranks})}


def main():
    args = distenv.lab_parser(__doc__).parse_args()
    with distenv.initialize(args) as env:
        result = env.write_result(args, run(env))
        if result is not None:
            for r in result["ranks"]:
                env.print0(f"rank {r['rank']}: node {r['group_rank']}, local rank "
                           f"{r['local_rank']}, pid {r['pid']} (agent {r['agent_pid']})")


if __name__ == "__main__":
    main()
