"""`NodeWatch` (actors/driver/nodes.py) on made-up node tables, without Ray: which workers a lost
node held, the one line printed per change, when each worker answered again and where, and what
consumed.json and the run summary get.  The multi-node runs are tests/actors/test_node_loss.py."""
import json

from actors.driver.nodes import NodeWatch
from opd.run.summary import node_lines

HEAD, R1, R2, R3, T1 = "head" + "0" * 52, "r1" + "1" * 54, "r2" + "2" * 54, "r3" + "3" * 54, "t1" + "4" * 54


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def node(ip: str, **res) -> dict:
    return {"ip": ip, "resources": {"CPU": 1.0, **res}}


def watch():
    clock, lines = Clock(), []
    w = NodeWatch(log=lines.append, clock=clock, poll_s=0.0)
    w.update(0, {HEAD: node("10.0.0.1", opd_learner=1.0), R1: node("10.0.0.2", opd_rollout=1.0),
                 R2: node("10.0.0.3", opd_rollout=1.0), T1: node("10.0.0.4", opd_teacher=1.0)})
    w.placed("learner", 0, HEAD)
    w.placed("rollout", 0, R1)
    w.placed("rollout", 1, R2)
    w.placed("teacher", 0, T1)
    return w, clock, lines


def test_a_lost_node_names_the_workers_it_held_and_when_each_was_remade():
    w, clock, lines = watch()
    assert lines == []                                      # the first look only remembers
    clock.t = 110.0
    lost = w.update(5, {HEAD: node("10.0.0.1"), R2: node("10.0.0.3"), T1: node("10.0.0.4")})
    assert lost == [("rollout", 0)]
    assert lines == ["node 10.0.0.2 (r1111111) lost at step 5: rollout worker 0; their parts "
                     "are issued again"]
    clock.t = 112.5
    w.stepped(5)
    w.update(6, {HEAD: node("10.0.0.1"), R2: node("10.0.0.3"), T1: node("10.0.0.4"),
                 R3: node("10.0.0.5", opd_rollout=1.0)})
    assert lines[-1] == "node 10.0.0.5 (r3333333) added at step 6: opd_rollout 1, CPU 1"
    clock.t = 114.25
    w.placed("rollout", 0, R3)                              # its probe answered from R3
    assert lines[-1] == ("rollout worker 0 re-made on node 10.0.0.5 (r3333333), 4.2 s after "
                         "node r1111111 was lost")
    w.stepped(6)                                            # only the first step after counts
    lost_event, added = w.events
    assert lost_event == {"event": "lost", "node": R1, "ip": "10.0.0.2", "step": 5, "t": 10.0,
                          "workers": ["rollout/0"], "next_step": 5, "next_step_s": 2.5,
                          "remade": {"rollout/0": {"node": R3, "after_s": 4.25}}}
    assert added["event"] == "added" and added["resources"] == {"CPU": 1.0, "opd_rollout": 1.0}
    assert w.ran_on() == {"learner": [{"node": HEAD, "ip": "10.0.0.1"}],
                          "rollout": [{"node": R1, "ip": "10.0.0.2"}, {"node": R2, "ip": "10.0.0.3"},
                                      {"node": R3, "ip": "10.0.0.5"}],
                          "teacher": [{"node": T1, "ip": "10.0.0.4"}]}
    assert len(lines) == 3                                  # one line per change


def test_a_node_without_workers_and_the_learner_node():
    w, clock, lines = watch()
    w.update(1, {HEAD: node("10.0.0.1"), R1: node("10.0.0.2"), R2: node("10.0.0.3"),
                 T1: node("10.0.0.4"), R3: node("10.0.0.5")})
    assert w.update(2, {HEAD: node("10.0.0.1"), R1: node("10.0.0.2"), R2: node("10.0.0.3"),
                        T1: node("10.0.0.4")}) == []
    assert lines[-1] == "node 10.0.0.5 (r3333333) lost at step 2: no worker of this run"
    assert w.update(3, {R1: node("10.0.0.2"), R2: node("10.0.0.3"),
                        T1: node("10.0.0.4")}) == [("learner", 0)]
    assert lines[-1].endswith("learner worker 0; the learner group is lost, the run stops at "
                              "its last checkpoint")


def test_poll_looks_at_most_every_poll_s_and_reads_ray_s_node_table():
    clock, lines, looks = Clock(), [], []
    table = [{"NodeID": HEAD, "Alive": True, "NodeManagerAddress": "10.0.0.1",
              "Resources": {"CPU": 2.0}},
             {"NodeID": R1, "Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {}}]
    w = NodeWatch(log=lines.append, clock=clock, poll_s=1.0,
                  table=lambda: looks.append(clock.t) or table)
    for t, step in ((0.0, 0), (0.5, 1), (1.0, 2), (1.9, 3), (2.0, 4)):
        clock.t = 100.0 + t
        w.poll(step)
    assert looks == [100.0, 101.0, 102.0]
    assert w.live == {HEAD: {"ip": "10.0.0.1", "resources": {"CPU": 2.0}}}   # dead rows dropped


def test_consumed_record_reads_back_as_summary_lines(tmp_path):
    w, clock, _ = watch()
    clock.t = 110.0
    w.update(5, {HEAD: node("10.0.0.1"), R2: node("10.0.0.3"), T1: node("10.0.0.4")})
    clock.t = 113.0
    w.stepped(5)
    w.placed("rollout", 0, R2)
    (tmp_path / "consumed.json").write_text(json.dumps({"nodes": w.ran_on(),
                                                        "node_events": w.events}))
    assert node_lines(tmp_path) == [
        "learner ran on 1 node: 10.0.0.1 (head0000)",
        "rollout ran on 2 nodes: 10.0.0.2 (r1111111), 10.0.0.3 (r2222222)",
        "teacher ran on 1 node: 10.0.0.4 (t1444444)",
        "node 10.0.0.2 (r1111111) lost at step 5: held rollout/0; re-made rollout/0 on r2222222 "
        "after 3.0 s; next step trained 3.0 s later"]
    assert node_lines(tmp_path / "nowhere") == []
