"""A long run whose memory stays flat (scripts/memory_soak.py): 2,000 tiny ray-mode steps with
a KD phase and an on-policy GKD phase, evaluations and checkpoints; each role's RSS, the
driver's RSS and the object store sampled at steps 100, 1,000 and 2,000; growth beyond 5 %
between 1,000 and 2,000 fails, naming the role.  Minutes long: marked slow (the figures of a
run are in docs/RELIABILITY.md)."""
import pytest

from scripts import memory_soak


def test_growth_names_the_role():
    before = {"teacher/0": 600.0, "driver": 900.0, "object_store": 0.5}
    after = {"teacher/0": 640.0, "driver": 910.0, "object_store": 2.0}
    assert memory_soak.growth(before, after, 0.05) == ["teacher/0: 600.0 -> 640.0 MiB (+6.7 %)"]
    assert memory_soak.growth(before, {**after, "object_store": 4.0}, 0.05) == [
        "teacher/0: 600.0 -> 640.0 MiB (+6.7 %)", "object_store: 0.5 -> 4.0 MiB (+10.9 %)"]


@pytest.mark.slow
def test_memory_stays_flat_over_2000_steps(opd_cache, capsys):
    code = memory_soak.main(["--steps", "2000", "--samples", "100,1000,2000"])
    out = capsys.readouterr()
    assert code == 0, out.err
