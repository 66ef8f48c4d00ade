"""The trace reader (labs/labkit/predict/trace_reader.py, labs/trace.py) on hand-made
traces whose answers are known: a CUDA-shaped one, kernels on a compute stream and an NCCL
stream overlapping in part, and a CPU-shaped one, gloo's worker thread beside the model's;
then bad input, one line each. The labs' own traces (--profile) are read in the FSDP and
pipeline labs' tests, in launches they make anyway."""

import json

import pytest

from labkit.predict import trace_reader as tr
from conftest import assert_fails_with_one_line


def complete(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def cuda_trace(rank=0):
    """One step on the CPU, [0, 1000] us; its kernels, launched inside it, run later on the
    GPU: compute on stream 7 at [100, 400] and [500, 700], NCCL on stream 20 at [350, 600]
    (an all-reduce) and [800, 900] (an all-gather). A kernel launched after the step, at
    [1600, 1700], is not the step's."""
    kernels = [("ampere_sgemm_128x64", 100, 300, 7), ("ampere_sgemm_128x64", 500, 200, 7),
               ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 350, 250, 20),
               ("ncclKernel_AllGather_RING_LL_Sum_int8_t", 800, 100, 20),
               ("ampere_sgemm_128x64", 1600, 100, 7)]
    events = [complete("ProfilerStep#3", 0, 1000, cat="user_annotation")]
    for correlation, (name, ts, dur, stream) in enumerate(kernels):
        launch = 1500 if ts == 1600 else 10 * correlation
        events.append(complete("cudaLaunchKernel", launch, 5, cat="cuda_runtime",
                               correlation=correlation))
        events.append(complete(name, ts, dur, cat="kernel", tid=stream, stream=stream,
                               correlation=correlation))
    return {"traceEvents": events, "distributedInfo": {"rank": rank}}


def test_a_cuda_trace_counts_its_kernels_by_stream_and_name():
    r = tr.analyze(cuda_trace(rank=3))
    assert r["rank"] == 3 and r["kind"] == "cuda" and r["steps"] == 1
    assert r["window_s"] == pytest.approx(800e-6)                  # 100 ... 900
    assert r["compute_s"] == pytest.approx(500e-6)                 # 300 + 200
    assert r["communication_s"] == pytest.approx(350e-6)           # 250 + 100
    assert r["exposed_communication_s"] == pytest.approx(200e-6)   # 400-500, 800-900
    assert r["overlap_fraction"] == pytest.approx(1 - 200 / 350)
    assert r["idle_s"] == pytest.approx(100e-6)                    # 700-800
    assert r["not_computing_fraction"] == pytest.approx(1 - 500 / 800)
    assert r["collectives"] == {"all_gather": 1, "all_reduce": 1}


def test_a_cpu_trace_reads_gloo_s_thread_beside_the_model_s():
    """Model thread 1: matmuls at [0, 300] and [310, 500], between them the call that hands
    an all-reduce to gloo (not computation); gloo's thread 2 runs it at [305, 800]."""
    events = [complete("ProfilerStep#1", 0, 1000, cat="user_annotation"),
              complete("aten::mm", 0, 300), complete("c10d::allreduce_", 300, 10),
              complete("aten::mm", 310, 190),
              complete("gloo:all_reduce", 305, 495, cat="user_annotation", tid=2),
              complete("gloo:broadcast", 2000, 50, cat="user_annotation", tid=2)]  # after
    r = tr.analyze({"traceEvents": events})
    assert r["kind"] == "cpu" and r["rank"] == 0
    assert r["window_s"] == pytest.approx(1000e-6)
    assert r["compute_s"] == pytest.approx(490e-6)
    assert r["communication_s"] == pytest.approx(495e-6)
    assert r["exposed_communication_s"] == pytest.approx(305e-6)   # 305-310, 500-800
    assert r["idle_s"] == pytest.approx(205e-6)        # 300-305 (the handoff), 800-1000
    assert r["collectives"] == {"all_reduce": 1}


def test_interval_arithmetic_by_hand():
    assert tr.union([[5, 7], [0, 2], [1, 3], [7, 8]]) == [[0, 3], [5, 8]]
    assert tr.subtract([[0, 10]], [[2, 3], [5, 12]]) == [[0, 2], [3, 5]]
    assert tr.intersect([[0, 4], [6, 10]], [[3, 7], [9, 20]]) == [[3, 4], [6, 7], [9, 10]]
    assert tr.collective_kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "reduce_scatter"
    assert tr.collective_kind("ncclDevKernel_SendRecv") == "send_recv"
    assert tr.collective_kind("gloo:all_to_all") == "all_to_all"
    # torch's "Collective name" args, and NCCL's symmetric-memory kernels (2.27 on)
    assert [tr.collective_kind(name) for name in (
        "all_to_allv", "_reduce_scatter_base", "allgather_into_tensor_coalesced", "coalesced",
        "ncclSymkDevKernel_AllReduce_RSxLDMC_AGxSTMC_sum_bf16")] == [
        "all_to_all", "reduce_scatter", "all_gather", "other", "all_reduce"]


def test_traces_of_several_ranks_and_one_rank_twice():
    texts = [(f"r{r}.json", json.dumps(cuda_trace(rank=r))) for r in (1, 0)]
    assert list(tr.analyze_texts(texts)["ranks"]) == [0, 1]
    with pytest.raises(tr.TraceError, match="a second trace of rank 0"):
        tr.analyze_texts(texts[1:] * 2)


@pytest.mark.parametrize("content, words", [
    ("def main(): pass", "not a trace (not JSON"),
    (json.dumps({"schema": 1, "spans": []}), "a trace of another format"),
    (json.dumps({"traceEvents": [complete("aten::mm", 0, 5)]}), "no profiled steps"),
])
def test_bad_input_is_one_line(script, tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert_fails_with_one_line(script("trace", "analyze", path), words)


def test_a_gzipped_trace_reads_as_the_plain_one_and_a_broken_one_is_one_line(tmp_path):
    import gzip
    plain = json.dumps(cuda_trace())
    (tmp_path / "r.json.gz").write_bytes(gzip.compress(plain.encode()))
    assert tr.analyze(tr.load_file(tmp_path / "r.json.gz")) == tr.analyze(tr.load(plain))
    (tmp_path / "broken.json.gz").write_bytes(gzip.compress(plain.encode())[:40])
    with pytest.raises(tr.TraceError, match="a broken .gz file"):
        tr.load_file(tmp_path / "broken.json.gz")


def test_memory_over_a_step_is_the_allocator_s_running_total_inside_the_steps():
    """torch.profiler's "[memory]" instant events, with profile_memory=True: the CPU's
    (Device Type 0) inside the profiled steps, in time order from the steps' start."""
    def memory(ts, total, device=0):
        return {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
                "args": {"Total Allocated": total, "Bytes": 1, "Device Type": device}}
    events = [complete("ProfilerStep#1", 100, 900, cat="user_annotation"),
              memory(50, 7), memory(200, 4096), memory(300, 1024), memory(400, 9, device=1),
              memory(1200, 0)]
    assert tr.memory_timeline({"traceEvents": events}) == [(100e-6, 4096), (200e-6, 1024)]
    assert tr.memory_timeline({"traceEvents": events}, "cuda") == [(300e-6, 9)]
    with pytest.raises(tr.TraceError, match="no profiled steps"):
        tr.memory_timeline({"traceEvents": events[1:]})


def test_the_trace_page_gives_each_rank_per_step_and_the_planner_beside_it():
    """labkit.predict.trace_page, the page's entry point: the reader's figures over the
    steps, and the planner's step for the run's fields, whose parts add up to it."""
    from labkit.predict import sizing, trace_page
    two_steps = cuda_trace()
    two_steps["traceEvents"].append(complete("ProfilerStep#4", 1000, 1000,
                                             cat="user_annotation"))
    text = json.dumps(two_steps)
    reply = trace_page.answer([("rank0.json", text)], {})
    rank = reply["ranks"][0]
    whole = tr.analyze(two_steps)
    assert reply["prediction"] is None and rank["steps"] == whole["steps"] == 2
    assert rank["step_s"] == pytest.approx(whole["window_s"] / 2)
    assert rank["exposed_communication_s"] == pytest.approx(whole["exposed_communication_s"] / 2)
    assert rank["collectives_per_step"] == {"all_gather": 0.5, "all_reduce": 0.5}
    fields = {"model": "llama3-70b", "gpus": "64", "global_batch_tokens": "1M",
              "layout": "tp=8,pp=2,dp=4"}
    predicted = trace_page.answer([("rank0.json", text)], fields)["prediction"]
    assert predicted["named"] and predicted["layout"]["tp"] == 8
    assert predicted["step_s"] == pytest.approx(predicted["compute_s"] + predicted["bubble_s"]
                                                + predicted["exposed_communication_s"])
    with pytest.raises(sizing.SizingError, match="has no prediction"):
        trace_page.answer([("rank0.json", text)], {**fields, "layout": "tp=8,pp=1,dp=1"})


def test_on_cpu_only_aten_s_own_time_computes_and_a_wait_in_a_hook_is_exposed():
    """On the model's thread, an autograd node [0, 1000] runs a matmul [100, 300] that
    calls a copy [150, 200], then a hook that hands an all-reduce to gloo [400, 420] and
    waits for it, recording nothing, until 900; gloo's thread runs it [350, 900]. Only
    ATen's operators compute, each in its own time: 100-300 (the copy's time is the
    copy's); the node's own time, the hook and its wait, is not computation."""
    events = [complete("ProfilerStep#1", 0, 1000, cat="user_annotation"),
              complete("autograd::engine::evaluate_function: AddmmBackward0", 0, 1000),
              complete("aten::mm", 100, 200), complete("aten::copy_", 150, 50),
              complete("c10d::allreduce_", 400, 20),
              complete("gloo:all_reduce", 350, 550, cat="user_annotation", tid=2)]
    assert tr.own_time([e for e in events if e["cat"] == "cpu_op"]) == [
        [100, 150], [150, 200], [200, 300]]
    r = tr.analyze({"traceEvents": events})
    assert r["compute_s"] == pytest.approx(200e-6)
    assert r["exposed_communication_s"] == pytest.approx(550e-6)    # 350-900
    assert r["overlap_fraction"] == 0.0
    assert r["idle_s"] == pytest.approx(250e-6)                      # 0-100, 300-350, 900-1000


# Real GPU traces from outside this project: HolisticTraceAnalysis's test data (MIT),
# tests/data/traces/README.md says which files and what each holds.
TRACES = __import__("pathlib").Path(__file__).parent / "data" / "traces"


def as_hta(trace, include_last_step=False):
    """The trace as HolisticTraceAnalysis selects from it (hta/common/trace.py,
    _filter_irrelevant_gpu_kernels; hta/common/trace_parser.py, round_down_time_stamps):
    float timestamps rounded inward to whole microseconds (start up, end down); GPU events
    without a launch record dropped; only those launched before the last ProfilerStep
    began (or before it ended, with include_last_profiler_step=True), from the trace's
    first CPU event on. Said to the reader as one profiled step covering that span."""
    import math
    events = [dict(e) for e in trace["traceEvents"] if e.get("ph") == "X"]
    if any(isinstance(e["ts"], float) for e in events):
        for e in events:
            start, end = math.ceil(e["ts"]), math.floor(e["ts"] + e["dur"])
            e["ts"], e["dur"] = start, end - start
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]}
    events = [e for e in events if e.get("cat") not in tr.GPU_CATEGORIES
              or e["args"].get("correlation") in launches]
    steps = [e for e in events if tr.STEP.match(e["name"])]
    last = max(steps, key=lambda e: e["ts"])
    until = last["ts"] + last["dur"] if include_last_step else last["ts"] - 1e-3
    cpu = [e for e in events if e.get("cat") not in tr.GPU_CATEGORIES]
    start = min(e["ts"] for e in cpu)
    events = [e for e in events if not tr.STEP.match(e["name"])]
    events.append(complete("ProfilerStep#0", start, until - start, cat="user_annotation"))
    return {**trace, "traceEvents": events}


# HTA 0.6.1 (commit f4d0062) on these files, get_temporal_breakdown and
# get_comm_comp_overlap, in us: (idle, compute, non-compute, kernel time, overlap %)
HTA = {("sampled_rank-0", False): (321378, 106252, 172428, 600058, 11.81),
       ("sampled_rank-0", True): (675191, 210320, 337336, 1222847, 14.95),
       ("sampled_rank-1", False): (328671, 135548, 136455, 600674, 20.05),
       ("sampled_rank-1", True): (651136, 271973, 308077, 1231186, 19.93),
       ("trace_compare_base", False): (0, 4, 0, 4, None),
       ("trace_compare_base", True): (117124, 8, 0, 117132, None),
       ("nccl_data_slim", False): (338781, 75169, 21636, 435586, 14.31),
       ("nccl_data_slim", True): (506512, 113012, 41026, 660550, 15.14)}


@pytest.fixture(scope="module")
def real():
    return {path.name.split(".")[0]: tr.load_file(path) for path in TRACES.glob("*.json.gz")}


@pytest.mark.parametrize("name, include_last_step", sorted(HTA))
def test_on_real_gpu_traces_the_reader_gives_hta_s_figures_on_hta_s_selection(
        real, name, include_last_step):
    """Where both count the same events, HTA's idle is the reader's, its compute the
    reader's, its non-compute the reader's exposed communication plus memory copies, its
    kernel time the reader's window, and its overlap the reader's, to the digit."""
    idle, compute, non_compute, window, overlap = HTA[name, include_last_step]
    r = tr.analyze(as_hta(real[name], include_last_step))
    assert r["idle_s"] * 1e6 == pytest.approx(idle, abs=1e-3)
    assert r["compute_s"] * 1e6 == pytest.approx(compute, abs=1e-3)
    assert (r["exposed_communication_s"] + r["memory_copy_s"]) * 1e6 == pytest.approx(
        non_compute, abs=1e-3)
    assert r["window_s"] * 1e6 == pytest.approx(window, abs=1e-3)
    assert (None if r["overlap_fraction"] is None
            else round(100 * r["overlap_fraction"], 2)) == overlap


def test_where_the_reader_and_hta_differ_on_real_traces(real):
    """On the files as they are, the reader keeps what HTA leaves out: the last profiled
    step (HTA drops it by default), GPU events with no launch record (trace_compare_base:
    four of its six kernels, and its copies), and sub-microsecond timestamps (nccl_data:
    HTA rounds each event inward, ~1 us apiece over 2,700 kernels)."""
    for name in ("sampled_rank-0", "sampled_rank-1"):   # integer timestamps, all launched
        mine = tr.analyze(real[name])
        assert mine["idle_s"] * 1e6 == pytest.approx(HTA[name, True][0], abs=1e-3)
        assert mine["window_s"] * 1e6 > HTA[name, False][3] * 1.5   # two steps, not one
    base = tr.analyze(real["trace_compare_base"])
    assert base["window_s"] * 1e6 > 2 * HTA["trace_compare_base", True][3]
    assert base["memory_copy_s"] > 0
    ns = tr.analyze(real["nccl_data_slim"])
    assert ns["compute_s"] * 1e6 - HTA["nccl_data_slim", True][1] == pytest.approx(2644, abs=1)


def test_a_real_torchrec_trace_s_all_to_alls_are_not_a_pipeline_stage(real):
    """sampled_rank-0: all ten NCCL kernels are named ncclKernel_SendRecv; the c10d ops
    that launched them say four all-to-alls (TorchRec's All2All_Pooled_Req), four
    all-reduces and two all-gathers. By name alone it read as a pipeline stage with a
    bubble of 83 %."""
    kernels = [e["name"] for e in real["sampled_rank-0"]["traceEvents"]
               if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    assert len(kernels) == 10 and all("SendRecv" in name for name in kernels)
    r = tr.analyze(real["sampled_rank-0"])
    assert r["collectives"] == {"all_gather": 2, "all_reduce": 4, "all_to_all": 4}
    assert r["bubble_fraction"] is None
    assert r["memory_copy_s"] * 1e6 == pytest.approx(353)
    parts = r["compute_s"] + r["exposed_communication_s"] + r["memory_copy_s"] + r["idle_s"]
    assert parts == pytest.approx(r["window_s"], abs=1e-9)


def test_each_collective_s_size_and_bus_bandwidth_from_its_args(real):
    """nccl_data_slim (2 ranks, A100): every NCCL kernel carries torch's collective args;
    its message is the larger of In/Out msg nelems times the dtype's bytes (nccl-tests'
    S), its bus bandwidth comm_model.bus_bandwidth's: 2(n-1)/n = 1 x algbw at n = 2."""
    from labkit.predict import comm_model
    r = tr.analyze(real["nccl_data_slim"])
    assert r["collectives"] == {"all_reduce": 15, "broadcast": 6}
    first = next(c for c in r["per_collective"] if c["kind"] == "all_reduce")
    assert (first["group"], first["group_size"], first["bytes"]) == ("default_pg", 2, 2049000 * 4)
    assert first["busbw_bytes_per_s"] == pytest.approx(
        comm_model.bus_bandwidth("all_reduce", 8196000, first["dur_s"], 2))
    assert first["algbw_bytes_per_s"] == pytest.approx(8196000 / first["dur_s"])
    assert list(r["exposed_by_group_s"]) == ["default_pg"]
    assert r["exposed_by_group_s"]["default_pg"] == pytest.approx(r["exposed_communication_s"])


def collective_kernel(name, ts, dur, correlation, stream=20, **args):
    return complete(name, ts, dur, cat="kernel", tid=stream, stream=stream,
                    correlation=correlation, **args)


def test_args_name_the_collective_copies_are_their_own_and_groups_split_exposure():
    """One step [0, 1000]: compute [0, 300]; an all-to-all of the expert group, run as
    ncclDevKernel_SendRecv, [300, 500]; a bf16 all-reduce of the data group [400, 700];
    a Memcpy HtoD [700, 800], nothing else running; a DtoD copy that record_param_comms
    launched (NCCL's copy engine) [850, 900]. The all-to-all is not a send, so no bubble."""
    expert = {"Collective name": "all_to_allv", "In msg nelems": 4096, "Out msg nelems": 8192,
              "Group size": 4, "dtype": "BFloat16", "Process Group Name": "3",
              "Process Group Description": "expert"}
    data = {**expert, "Collective name": "allreduce", "In msg nelems": 1 << 20,
            "Out msg nelems": 1 << 20, "Process Group Name": "1", "Process Group Description": "data"}
    events = [complete("ProfilerStep#1", 0, 1000, cat="user_annotation"),
              complete("record_param_comms", 840, 20, cat="cpu_op", **data)]
    for c in range(5):   # every launch at 10 c; the fifth inside record_param_comms
        events.append(complete("cudaLaunchKernel", 845 if c == 4 else 10 * c, 1,
                               cat="cuda_runtime", correlation=c))
    events += [collective_kernel("sm90_xmma_gemm_bf16", 0, 300, 0, stream=7),
               collective_kernel("ncclDevKernel_SendRecv", 300, 200, 1, **expert),
               collective_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 400, 300, 2, **data),
               complete("Memcpy HtoD (Pageable -> Device)", 700, 100, cat="gpu_memcpy", tid=7,
                        correlation=3),
               complete("Memcpy DtoD (Device -> Device)", 850, 50, cat="gpu_memcpy", tid=21,
                        correlation=4)]
    r = tr.analyze({"traceEvents": events})
    assert r["collectives"] == {"all_reduce": 2, "all_to_all": 1} and r["bubble_fraction"] is None
    assert r["window_s"] == pytest.approx(900e-6)
    assert r["compute_s"] == pytest.approx(300e-6)
    assert r["exposed_communication_s"] == pytest.approx(450e-6)   # 300-700, 850-900
    assert r["memory_copy_s"] == pytest.approx(100e-6) and r["idle_s"] == pytest.approx(50e-6)
    assert r["exposed_by_group_s"] == pytest.approx({"data": 350e-6, "expert": 200e-6})
    a2a = r["per_collective"][0]
    assert (a2a["kind"], a2a["group"], a2a["bytes"]) == ("all_to_all", "expert", 8192 * 2)
    assert a2a["busbw_bytes_per_s"] == pytest.approx(8192 * 2 / 200e-6 * 3 / 4)
    copy = r["per_collective"][-1]
    assert copy["kind"] == "all_reduce" and copy["group"] == "data"   # its launcher's args


def test_a_late_rank_is_named_and_the_others_waits_are_accounted_to_it():
    """Three ranks, one group, two all-reduces a step: rank 2 starts each 5 ms after the
    others, whose kernels therefore last 5 ms longer than its 1 ms (the transfer)."""
    def rank_trace(rank):
        late = 5000 if rank == 2 else 0
        events = [complete("ProfilerStep#1", 0, 30000, cat="user_annotation")]
        for c, start in enumerate((1000, 12000)):
            events.append(complete("cudaLaunchKernel", 10 * c, 1, cat="cuda_runtime",
                                   correlation=c))
            events.append(collective_kernel(
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL", start + late, 1000 + 5000 - late, c,
                **{"Collective name": "allreduce", "Process Group Name": "0", "Group size": 3}))
        return {"traceEvents": events, "distributedInfo": {"rank": rank},
                "baseTimeNanoseconds": 10**18}
    s = tr.analyze_all([(f"r{r}", rank_trace(r)) for r in range(3)])["stragglers"]
    assert s["matched"] == 2 and s["straggler"] == 2
    assert s["by_rank"][2] == {"last": 2, "caused_wait_s": pytest.approx(4 * 5e-3),
                               "waited_s": 0.0}
    assert s["by_rank"][0]["waited_s"] == pytest.approx(2 * 5e-3)
    assert s["worst"][0]["late_s"] == pytest.approx(5e-3)
    assert s["worst"][0]["transfer_s"] == pytest.approx(1e-3)


def test_the_trace_page_draws_each_rank_on_one_clock_and_tables_its_collectives(real):
    """trace_page.answer on the two real ranks: the timeline's intervals are the reader's
    (their lengths add to its computing time), on one clock (rank 1's window began 0.153
    ms after rank 0's), and each rank's collectives by group and kind, a step."""
    import gzip
    from labkit.predict import trace_page
    texts = [(name, gzip.decompress((TRACES / f"{name}.json.gz").read_bytes()).decode())
             for name in ("sampled_rank-0", "sampled_rank-1")]
    reply = trace_page.answer(texts, {})
    zero = tr.analyze(real["sampled_rank-0"])
    drawn = reply["timelines"][0]
    assert sum(e - s for s, e in drawn["compute"]) == pytest.approx(zero["compute_s"] * 1e3)
    assert [t["offset_ms"] for t in reply["timelines"]] == pytest.approx([0.0, 0.153])
    rank = reply["ranks"][0]
    assert rank["memory_copy_s"] == pytest.approx(zero["memory_copy_s"] / 2)
    assert [(c["kind"], c["per_step"]) for c in rank["collective_table"]] == [
        ("all_gather", 1.0), ("all_reduce", 2.0), ("all_to_all", 2.0)]
    assert reply["stragglers"]["matched"] == 8


def test_the_command_line_names_the_rank_the_other_waited_for(script):
    """labs/trace.py on the two real ranks: each rank's memory copies and exposed time by
    group, and the straggler line, as analyze_all finds them."""
    paths = [TRACES / f"sampled_rank-{r}.json.gz" for r in (0, 1)]
    done = script("trace", "analyze", *paths)
    assert done.returncode == 0, done.stderr
    expected = tr.analyze_all([(p.name, tr.load_file(p)) for p in paths])
    assert "copies" in done.stdout.splitlines()[0]
    assert "exposed in group unknown: 0.3370 s" in done.stdout
    assert (f"{expected['stragglers']['matched']} collectives matched across ranks; the "
            f"others waited longest for rank {expected['stragglers']['straggler']}:") in done.stdout


def test_the_page_splits_exposed_communication_as_the_planner_does():
    """Groups named by torch's DeviceMesh (mesh_tp, mesh_dp_shard) map to the planner's
    parts; a group it does not name (default_pg) to none. One step [0, 1000]: a tp
    all-reduce [0, 100] and a dp reduce-scatter [200, 500], nothing computing beside them;
    the planner's parts add up to its exposed communication."""
    from labkit.predict import trace_page
    events = [complete("ProfilerStep#1", 0, 1000, cat="user_annotation")]
    for c, (name, ts, dur, group) in enumerate((
            ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 100, "mesh_tp"),
            ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 200, 300, "mesh_dp_shard"),
            ("ncclDevKernel_Broadcast_RING_LL", 600, 50, "default_pg"))):
        events.append(complete("cudaLaunchKernel", c, 1, cat="cuda_runtime", correlation=c))
        events.append(collective_kernel(name, ts, dur, c, **{
            "Collective name": name.split("_")[1].lower(), "Process Group Description": group}))
    fields = {"model": "llama3-70b", "gpus": "64", "global_batch_tokens": "1M",
              "layout": "tp=8,pp=2,dp=4"}
    reply = trace_page.answer([("r0.json", json.dumps({"traceEvents": events}))], fields)
    assert reply["ranks"][0]["exposed_by_part_s"] == pytest.approx({"tp": 100e-6, "dp": 300e-6})
    planned = reply["prediction"]["exposed_by_part_s"]
    assert set(planned) == set(trace_page.EXPOSED_PARTS)
    assert sum(planned.values()) == pytest.approx(reply["prediction"]["exposed_communication_s"])
