"""bench/engine_children.py with stand-in children (no vLLM, no GPU): the GPU benches' engines
started together must still measure one at a time, a child that dies while starting beside the
others runs again alone, and a hung child is killed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import engine_children  # noqa: E402

# A stand-in engine child: "starts" for START seconds (printing, as vLLM does, more than a pipe
# holds, so a held child that nobody reads would block), then (held) waits for go, "measures"
# for RUN seconds, printing its own start/stop times. FAIL_FIRST: dies while starting beside
# the others (held), works alone. HANG: never ends.
CHILD = r'''
import json, os, sys, time
sys.path.insert(0, os.environ["BENCH"])
import engine_children
kind, start, run = sys.argv[1], float(os.environ["START"]), float(os.environ["RUN"])
hold = "--hold" in sys.argv
for i in range(400):
    print(f"{kind} start log line {i} " + "x" * 200, flush=True)
time.sleep(start)
if hold and os.environ.get("FAIL_FIRST") == kind:
    sys.exit(3)
if hold:
    engine_children.wait_for_go(lambda tag, obj: print(tag + " " + json.dumps(obj), flush=True))
t0 = time.time()
if os.environ.get("HANG") == kind:
    time.sleep(1000)
time.sleep(run)
port = sys.argv[sys.argv.index("--port") + 1] if "--port" in sys.argv else None
print("MEASURED " + json.dumps({"kind": kind, "t0": t0, "t1": time.time(), "port": port,
                                "cache": os.environ.get("VLLM_CACHE_ROOT")}), flush=True)
'''


def _specs(tmp_path, kinds, **env):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    base = {"BENCH": str(ROOT / "bench"), "START": "0.6", "RUN": "0.3", "PATH": "/usr/bin:/bin"}
    return [engine_children.Spec(kind=k, cmd=[sys.executable, str(script), k],
                                 env={**base, **env}) for k in kinds]


def _run(tmp_path, specs, together, timeout_s=30.0, wave=0):
    seen, done = [], {}

    def on_line(kind, line):
        seen.append((kind, line))

    engine_children.run(specs, tmp_path, on_line, timeout_s, together=together,
                        on_done=lambda k, rc, t: done.__setitem__(k, (rc, t)), wave=wave)
    measured = {json.loads(ln.split(" ", 1)[1])["kind"]: json.loads(ln.split(" ", 1)[1])
                for _, ln in seen if ln.startswith("MEASURED ")}
    return seen, done, measured


def test_together_starts_at_once_and_measures_one_at_a_time(tmp_path):
    kinds = ["a", "b", "c"]
    t = time.time()
    seen, done, m = _run(tmp_path, _specs(tmp_path, kinds), together=True)
    wall = time.time() - t
    assert set(m) == set(kinds) and {k: rc for k, (rc, _) in done.items()} == dict.fromkeys(kinds, 0)
    times = {k: t for k, (_, t) in done.items()}
    # every engine was up before the first one measured
    assert max(times[k]["ready"] for k in kinds) <= min(m[k]["t0"] for k in kinds)
    assert max(times[k]["spawn"] for k in kinds) < min(times[k]["ready"] for k in kinds)
    # measured one at a time, in kind order, each after its go
    for x, y in zip(kinds, kinds[1:], strict=False):
        assert m[x]["t1"] <= m[y]["t0"]
    for k in kinds:
        assert times[k]["go"] <= m[k]["t0"] and m[k]["t1"] <= times[k]["end"]
    # starts overlapped: 3 x 0.6 s in series would be at least 1.8 s before the last go
    assert times["c"]["go"] - times["a"]["spawn"] < 1.8 + 2 * 0.3
    assert wall < 3 * (0.6 + 0.3) + 5
    # lines reach on_line one child at a time: the starts in kind order, then the measurements
    runs = [k for i, (k, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != k]
    assert runs == kinds + kinds
    for k in kinds:  # each child's in its own order
        nums = [int(ln.split()[4]) for kk, ln in seen if kk == k and "start log line" in ln]
        assert nums == list(range(400))
    assert sum(1 for k, ln in seen if k == "b" and "start log line" in ln) == 400
    # each engine had its own compile-cache root, and its log file
    assert len({m[k]["cache"] for k in kinds}) == 3
    assert all((tmp_path / f"{k}.log").read_text().count("start log line") == 400 for k in kinds)


def test_one_after_the_other_by_default(tmp_path):
    seen, done, m = _run(tmp_path, _specs(tmp_path, ["a", "b"]), together=False)
    assert m["a"]["t1"] <= done["b"][1]["spawn"]  # b started after a ended
    assert m["a"]["cache"] is None and not any(ln.startswith("E2E_READY") for _, ln in seen)


def test_a_child_dying_beside_the_others_runs_again_alone(tmp_path):
    seen, done, m = _run(tmp_path, _specs(tmp_path, ["a", "b", "c"], FAIL_FIRST="b"),
                         together=True)
    assert set(m) == {"a", "b", "c"} and all(rc == 0 for rc, _ in done.values())
    assert m["b"]["t0"] > m["c"]["t1"]  # alone, after the others
    assert (tmp_path / "b.together.log").exists()


def test_a_child_too_slow_to_start_alone_is_not_run_again(tmp_path):
    """A wave of one that runs out of time while starting would run out again alone: it is
    ended, reported, and the next kind goes on (a slow start beside others still reruns)."""
    specs = _specs(tmp_path, ["a", "b"])
    specs[0] = engine_children.Spec(kind="a", cmd=specs[0].cmd, env={**specs[0].env, "START": "30"})
    t0 = time.time()
    seen, done, m = _run(tmp_path, specs, together=True, timeout_s=4.0, wave=1)
    assert "a" not in m and done["a"][0] != 0 and done["a"][1]["ready"] is None
    assert "b" in m and done["b"][0] == 0
    assert not (tmp_path / "a.together.log").exists()  # not moved aside for a rerun
    assert time.time() - t0 < 4.0 + engine_children.KILL_GRACE_S + 10  # one limit, not two


def test_waves_start_at_most_n_at_once(tmp_path):
    """--together-max 2 with five kinds: waves (a, b), (c, d), (e); a wave starts only once the
    one before has measured and ended; inside a wave starts overlap; a dying child of the
    second wave reruns alone after the last wave; every child keeps its own cache root."""
    kinds = ["a", "b", "c", "d", "e"]
    seen, done, m = _run(tmp_path, _specs(tmp_path, kinds, FAIL_FIRST="c"), together=True,
                         wave=2)
    assert set(m) == set(kinds) and all(rc == 0 for rc, _ in done.values())
    t = {k: tt for k, (_, tt) in done.items()}
    for x, y in (("a", "b"), ("d", "e")):  # measured one at a time, in order
        assert m[x]["t1"] <= m[y]["t0"]
    # the second wave (c, d) spawned after the first ended, the third after the second
    assert max(t["a"]["end"], t["b"]["end"]) <= t["d"]["spawn"]
    assert t["d"]["end"] <= t["e"]["spawn"]
    # a and b started together: b was spawned before a was ready
    assert t["b"]["spawn"] < t["a"]["ready"]
    assert m["c"]["t0"] > m["e"]["t1"] and (tmp_path / "c.together.log").exists()
    caches = [m[k]["cache"] for k in kinds if k != "c"]
    assert None not in caches and len(set(caches)) == 4


def test_log_names():
    assert engine_children.log_name("xkv:graphs") == "xkv_graphs.log"
    assert engine_children.log_name("xkv@verify_checksums=off") == "xkv@verify_checksums=off.log"
    assert engine_children.log_name("a/b c") == "a_b_c.log"


@pytest.mark.parametrize("together", [False, True])
def test_a_hung_child_is_killed_and_the_rest_go_on(tmp_path, together):
    seen, done, m = _run(tmp_path, _specs(tmp_path, ["a", "b"], HANG="a"), together=together,
                         timeout_s=3.0)
    assert done["a"][0] != 0 and "a" not in m
    assert done["b"][0] == 0 and "b" in m


def test_gateway_port_reaches_the_child(tmp_path):
    specs = _specs(tmp_path, ["x", "y"])
    for s in specs:
        s.gateway, s.card, s.pass_pid = True, "16M", False
        s.env["PYTHONPATH"] = str(ROOT)
    seen, done, m = _run(tmp_path, specs, together=True)
    ports = {m[k]["port"] for k in ("x", "y")}
    assert len(ports) == 2 and None not in ports  # a gateway each, on its own port


def test_a_child_dying_while_it_waits_for_go_ends_quietly(tmp_path):
    """Ready, then dead before its turn: the run goes on (no broken pipe), its rc is reported."""
    script = tmp_path / "die.py"
    script.write_text("import json, os, sys, time\nsys.path.insert(0, os.environ['BENCH'])\n"
                      "print('E2E_READY {}', flush=True)\nsys.exit(7)\n")
    specs = _specs(tmp_path, ["a", "b"])
    specs[0].cmd = [sys.executable, str(script)]
    seen, done, m = _run(tmp_path, specs, together=True)
    assert done["a"][0] == 7 and "a" not in m
    assert done["b"][0] == 0 and "b" in m


def test_settings_that_cannot_start_together_are_refused():
    with pytest.raises(SystemExit, match="needs --kv-gib"):
        engine_children.check_together(3, 0.1, None)
    with pytest.raises(SystemExit, match=r"4 engines and --gpu-util 0.55.*<= 0.23"):
        engine_children.check_together(4, 0.55, 12)
    engine_children.check_together(4, 0.1, 12)  # fits
    engine_children.check_together(4, 0.4, 12, wave=2)  # two at a time fit
    with pytest.raises(SystemExit, match="--together-max -1"):
        engine_children.check_together(4, 0.1, 12, wave=-1)


def test_the_benches_options_become_run_keywords():
    """engine_children.together: what e2e_ttft, shared_prefix and profile_steps pass to run()
    from the shared options, with every refusal before anything starts."""
    import argparse

    ap = argparse.ArgumentParser()
    engine_children.add_args(ap)
    ap.add_argument("--gpu-util", type=float, default=0.1)

    def kw(*argv, engines=4):
        return engine_children.together(ap.parse_args(list(argv)), engines)

    assert kw() == {"together": False}
    assert kw("--start-together", "--kv-gib", "8") == {"together": True, "wave": 0}
    assert kw("--start-together", "--kv-gib", "8", "--together-max", "2",
              "--gpu-util", "0.4") == {"together": True, "wave": 2}
    with pytest.raises(SystemExit, match="--together-max 2 needs --start-together"):
        kw("--together-max", "2")
    with pytest.raises(SystemExit, match="needs --kv-gib"):
        kw("--start-together")
    with pytest.raises(SystemExit, match="4 engines and --gpu-util 0.4"):
        kw("--start-together", "--kv-gib", "8", "--gpu-util", "0.4")


def test_a_hung_child_s_own_processes_are_killed_too(tmp_path):
    """A hung child whose own child (an engine-core process) holds the output open: the kill
    takes both, the output closes, the next child runs (the H200 run of 2026-12-05 stalled on
    this until the step's own timeout)."""
    script = tmp_path / "hang_tree.py"
    script.write_text("import subprocess, sys, time\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      "print('started', flush=True)\ntime.sleep(600)\n")
    specs = _specs(tmp_path, ["a", "b"])
    specs[0].cmd = [sys.executable, str(script)]
    t = time.time()
    seen, done, m = _run(tmp_path, specs, together=False, timeout_s=3.0)
    assert done["a"][0] != 0 and done["b"][0] == 0 and "b" in m
    assert time.time() - t < 3.0 + engine_children.KILL_GRACE_S
