"""The hardware the book's extrapolations assume, stated once: H100 SXM GPUs in nodes of
eight joined by NVLink 4, one 400 Gb/s NDR InfiniBand card per GPU between nodes, as in
a DGX H100. The chapters that predict times on it (collectives, scaling, tensor
parallelism) import these; an exercise that varies one passes its own value.

Links are (alpha seconds per step, beta bytes per second per GPU) for the cost models of
comm_model and time_model. The betas are what NCCL reaches, not the line rates:
  NVLink 4     450 GB/s per direction per GPU (NVIDIA's H100 datasheet); NCCL gets about
               370 GB/s of it after protocol overhead (nccl-tests issue 212); we take 360
  NDR card     400 Gb/s = 50 GB/s (DGX H100 user guide); 46-48 GB/s per card measured
               with nccl-tests (nccl-tests issue 290); we take 48
The alphas are assumptions of the right order, not measurements.
"""

GPUS_PER_NODE = 8
NVLINK = (5e-6, 360e9)         # inside a node, per GPU
NIC = (10e-6, 48e9)            # between nodes, per network card, one card per GPU
NVLINK_LINE_RATE = 450e9       # bytes/s per direction per GPU
NIC_LINE_RATE = 50e9           # bytes/s, 400 Gb/s
# NVLS (NVLink SHARP: the NVSwitch adds the values) all-reduce on one node of 8 H100s, the
# busbw NCCL's maintainer gives as its peak, "~480GB/s (algbw ~275GB/s)" on large messages
# (nccl-tests issue 212). A measured rate, not a link's: see time_model.nvls_allreduce_time
NVLS_BUSBW = 480e9
# NCCL's own latency for an NVLS all-reduce inside a node of NVLink GPUs, one step of 25 us
# (hwLatencies, NVLINK, NVLS, Simple, in src/graph/tuning.cc of NCCL 2.30)
NVLS_ALPHA = 25e-6
H100_BF16_FLOPS = 989e12       # dense bf16 peak of the H100 SXM, FLOP/s
H100_NVL_BF16_FLOPS = 835e12   # the H100 NVL's: 1,671 TFLOP/s with sparsity, halved (datasheet)
# The memory nvidia-smi reports as an H100 80GB's total, 85.5 GB ("0MiB / 81559MiB" in
# NVIDIA/nccl issue 1264), and the total CUDA reports, 79.11 GiB (84.9 GB: what
# torch.cuda.OutOfMemoryError prints as the GPU's "total capacity" on an H100 80GB): the
# planner fits layouts in the nominal 80 GB less a reserve (planner.settings:
# RUNTIME_RESERVE_GB, ALL_TO_ALL_RESERVE_GB) for the CUDA context (about
# 400 MB with lazy loading: pytorch issue 109888), NCCL's buffers (0.5-0.7 GB a process
# group on A100s, nccl issue 964; 4.34 GB outside PyTorch's memory, context included,
# after an all-to-all on eight H100s, nccl issue 1685) and fragmentation (GMLake, ASPLOS 2024, needed 9.2 GB less than PyTorch's caching
# allocator on average over eight LLMs on A100 80GBs), which is not reserved: the 5-D
# chapter names the published layouts that leave less than that free
H100_80GB_REPORTED_MIB = 81_559
# HBM bandwidth, bytes/s (datasheets): the H100 SXM's 3.35 TB/s (the H800 SXM's is the
# same), the A100 80GB SXM's 2,039 GB/s. The planner's roofline for the routed experts'
# products (planner.expert_matmul_slowdown) reads them
H100_HBM_BYTES_S = 3.35e12
A100_80GB_HBM_BYTES_S = 2.039e12
H100_80GB_CUDA_GIB = 79.11
UTILIZATION = 0.40             # model FLOPs utilization of well-tuned training

# The DGX A100 servers of Selene, on which Narayanan et al. (2021, section 5) and Korthikanti
# et al. (2022, section 6) measured: NVLink 3 inside the node, eight 200 Gb/s HDR InfiniBand
# cards per node, one per GPU, between nodes. Line rates, to compare with the H100 box's.
A100_NVLINK_LINE_RATE = 300e9  # bytes/s per direction per GPU: 600 GB/s both ways (A100 datasheet)
HDR_NIC_LINE_RATE = 25e9       # bytes/s, 200 Gb/s
A100_BF16_FLOPS = 312e12       # dense bf16 peak of the A100, FLOP/s (A100 datasheet)

# Maximum achievable matmul FLOPS (MAMF): the fastest matrix product a search over shapes
# reached on one GPU, the mean of 100 runs of it (Bekman's ML Engineering book, its MAMF
# tables; torch 2.6.0 and 2.7.0 with CUDA 12.6; rough figures that rise with the software):
# in bf16, 86.9 % of the A100 SXM's peak and 80.3 % of the H100 SXM's; in FP8 (e4m3),
# 70.9 % of the H100 SXM's 1,979 TFLOP/s. The planner's compute efficiency is one fraction
# of the bf16 peak for both GPUs (the 5-D chapter tests taking it against these instead);
# its FP8 products run at the H100's measured FP8 rate over its bf16 rate
# (precision_model.FP8_MATMUL_RATIO), not the datasheet's two
A100_MAMF_FLOPS = 271.2e12
H100_MAMF_FLOPS = 794.5e12
H100_FP8_MAMF_FLOPS = 1402.6e12

# Model FLOPs utilization published for H100 training: Llama 3 405B, Table 4 of Dubey et al.
# (2024): 43 % on 8,192 GPUs, 41 % on 16,384, 38 % on 16,384 with 131,072-token sequences.
LLAMA3_H100_MFU = (0.38, 0.43)
