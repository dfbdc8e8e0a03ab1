"""Timeline: Chrome-trace events to per-rank spans of compute and communication."""

import json

import pytest

from ddptrain.plot import timeline
from ddptrain.plot.__main__ import main


def _event(name, ts_us, dur_us, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts_us, "dur": dur_us,
            "pid": 1, "tid": tid}  # fmt: skip


def _trace(rank, events):
    other = {"ph": "X", "name": "aten::mm", "ts": 0, "dur": 5}
    return {
        "baseTimeNanoseconds": 1_000_000_000,
        "distributedInfo": {"rank": rank},
        "traceEvents": [*events, other],
    }


def test_marks_become_step_and_comm_spans():
    """Trainer marks land on the step row, bucket reductions on the comm row, in host seconds."""
    trace = _trace(1, [
        _event("ddptrain.forward", 100, 50),
        _event("ddptrain.backward", 150, 100),
        _event("ddptrain.wait bucket 0", 230, 20),
        _event("ddptrain.reduce bucket 0", 200, 50, tid=2),
        _event("ddptrain.fill bucket 0", 160, 1),
    ])  # fmt: skip
    spans = timeline.trace_spans(trace, timeline.trace_rank(trace, 0))
    kinds = {(s.row, s.kind) for s in spans}
    assert kinds == {
        ("step", "forward"),
        ("step", "backward"),
        ("step", "exposed comm (wait)"),
        ("comm", timeline.COMM_KIND),
    }
    assert all(s.rank == 1 for s in spans)
    forward = next(s for s in spans if s.kind == "forward")
    assert forward.start_s == pytest.approx(1.0 + 100e-6) and forward.dur_s == pytest.approx(50e-6)


def test_reductions_are_drawn_where_they_ran_not_from_launch_to_wait():
    """A bucket's marked reduction is the comm span, not the launch-to-wait interval."""
    trace = _trace(0, [
        _event("ddptrain.launch bucket 0", 100, 5),
        _event("ddptrain.reduce bucket 0", 120, 70, tid=2),
        _event("ddptrain.wait bucket 0", 200, 10),
    ])  # fmt: skip
    comm = [s for s in timeline.trace_spans(trace, 0) if s.row == "comm"]
    assert [round((s.start_s - 1.0) * 1e6) for s in comm] == [120]
    assert [round(s.dur_s * 1e6) for s in comm] == [70]


def test_backend_all_reduce_spans_run_from_launch_to_wait_end():
    """Without reduction marks, a bucket is in flight from its launch to the end of its wait."""
    trace = _trace(0, [
        _event("ddptrain.launch bucket 0", 100, 5),
        _event("ddptrain.launch bucket 1", 150, 5),
        _event("ddptrain.wait bucket 0", 200, 10),
        _event("ddptrain.wait bucket 1", 210, 30),
    ])  # fmt: skip
    comm = sorted((s for s in timeline.trace_spans(trace, 0) if s.row == "comm"),
                  key=lambda s: s.start_s)  # fmt: skip
    assert [round((s.end_s - 1.0) * 1e6) for s in comm] == [210, 240]
    assert [round((s.start_s - 1.0) * 1e6) for s in comm] == [100, 150]


def test_cli_draws_a_timeline_and_refuses_traces_without_marks(tmp_path):
    """Two rank traces give a PNG (beside them without -o); a trace without marks exits 2."""
    pytest.importorskip("matplotlib")
    paths = []
    for rank in (0, 1):
        path = tmp_path / f"trace-rank{rank}.json"
        path.write_text(json.dumps(_trace(rank, [_event("ddptrain.forward", 10, 5)])))
        paths.append(str(path))
    out = tmp_path / "timeline.png"
    assert main(["--timeline", *paths, "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    out.unlink()
    assert main(["--timeline", *paths]) == 0  # no -o: beside the traces
    assert out.read_bytes()[:4] == b"\x89PNG"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_trace(0, [])))
    assert main(["--timeline", str(empty), "-o", str(out)]) == 2


def test_a_file_that_is_not_a_trace_is_named_in_one_line(tmp_path, capsys):
    """A truncated trace or a metrics.jsonl passed to --timeline: exit 2 naming that file."""
    good = tmp_path / "trace-rank0.json"
    good.write_text(json.dumps(_trace(0, [_event("ddptrain.forward", 10, 5)])))
    cut = tmp_path / "trace-rank1.json"
    cut.write_text(good.read_text()[:-20])
    lines = tmp_path / "metrics.jsonl"
    lines.write_text('{"step": 1}\n{"step": 2}\n')
    for bad in (cut, lines):
        assert main(["--timeline", str(good), str(bad), "-o", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ddptrain.plot: {bad}: not a Chrome trace (invalid JSON:"), err
        assert err.count("\n") == 1
