"""The preflight's table in a stage's log (pipeline.executor.preflight.one_line / table): identical healthy
workers in one line (64 GPUs of one kind made 65 lines of one row repeated), any worker that differs or has a
problem brings back the row per worker, so that the odd one is seen."""

from pipeline.executor.preflight import GB, one_line, table


def row(i, node="10.0.0.1", dtype="bfloat16", free=70.0, problems=(), **extra):
    return {"identity": f"n{node[-1]}/gpu{i}", "pid": 100 + i, "node_ip": node, "device_name": "NVIDIA H100",
            "gpu_ids": [str(i)], "dtype": dtype, "models": {"target": "ok", "draft": "ok"}, "output_dir": "rw",
            "memory": {"need": 20 * GB, "have": free * GB, "batch": 64}, "problems": list(problems), **extra}


def test_identical_healthy_workers_are_one_line_with_the_least_free_memory():
    rows = [row(i, node=f"10.0.0.{1 + i // 8}", free=70.0 - i / 10) for i in range(16)]
    line = one_line(rows)
    assert line == ("every worker NVIDIA H100, bfloat16, models ok, output rw, memory plan/budget 20.0/68.5 GiB "
                    "(batch 64), on 2 node(s)")
    assert len(table(rows)) == 17  # the full table (blockpilot preflight) keeps a row per worker


def test_a_worker_that_differs_or_fails_brings_the_table_back():
    healthy = [row(i) for i in range(4)]
    assert one_line(healthy) is not None
    assert one_line(healthy + [row(4, dtype="float32")]) is None  # another dtype
    assert one_line(healthy + [row(4, problems=[("model.target", "cannot load")])]) is None
    assert one_line(healthy + [row(4, models={"target": "ok", "draft": "FileNotFoundError"})]) is None
    assert one_line(healthy + [{"identity": "worker 4", "problems": []}]) is None  # never answered
    assert one_line(healthy + [row(4, memory={"need": 30 * GB, "have": 70 * GB, "batch": 32})]) is None
    assert one_line([]) is None
