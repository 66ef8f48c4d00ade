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
