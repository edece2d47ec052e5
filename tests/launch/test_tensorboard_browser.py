"""A run with the default loggers, opened as a user would: TensorBoard served on 127.0.0.1 for
its log directory and read in headless Chromium (scripts/tensorboard_view.py).  The Time Series
page (TensorBoard's default) lists one group per stage, each with as many cards as the event
files hold tags of that stage, and a card for every metrics.parquet column.  Skipped, with the fix, where Debian's
chromium and chromium-driver are not installed (.ci/run installs them)."""
import importlib.util
import re
from pathlib import Path

import pytest

from opd.config.schema import load_config
from opd.run.metrics_log import read_metrics
from opd.run.reference import run_reference
from opd.run.trackers import step_scalars

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("tensorboard_view",
                                              ROOT / "scripts" / "tensorboard_view.py")
view = importlib.util.module_from_spec(spec)
spec.loader.exec_module(view)

pytestmark = pytest.mark.skipif(view.missing() is not None, reason=view.missing() or "")


@pytest.fixture(scope="module")
def page(tiny_overrides, tmp_path_factory):
    """The run (default run.loggers), the tags its event files hold, and the page open on it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = load_config("tiny", [*tiny_overrides, "run.mode=reference", "distill.steps=3",
                               "run.checkpoint_every=3"])
    assert list(cfg.run.loggers) == ["tensorboard"]                 # the default under test
    run_dir = tmp_path_factory.mktemp("tb") / "run"
    run_reference(cfg, run_dir, progress=False)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    shown = set(events.Tags()["scalars"]) | set(events.Tags()["images"])
    with view.browser() as driver:
        view.open_time_series(driver, view.serve(run_dir))
        yield {"driver": driver, "run_dir": run_dir, "shown": shown}


def test_the_page_lists_one_group_per_stage(page):
    stages = sorted({t.split("/")[0] for t in page["shown"]})
    assert {"loss", "rollout", "teacher", "learner", "onpolicy", "queue", "quality",
            "samples"} <= set(stages)
    assert view.groups(page["driver"]) == stages


def test_each_group_holds_every_tag_of_its_stage(page):
    for stage in sorted({t.split("/")[0] for t in page["shown"]}):
        expected = sum(t.startswith(stage + "/") for t in page["shown"])
        assert view.matching(page["driver"], f"^{stage}/") == expected, stage


def test_every_metrics_column_has_its_card(page):
    """One filter naming every metrics.parquet column's tag exactly matches that many cards."""
    rows = read_metrics(page["run_dir"])
    tags = sorted(set().union(*(step_scalars(r, [rows[0]["phase"]]) for r in rows)))
    assert {"loss/loss", "learner/grad_norm", "onpolicy/onpolicy_logprob_delta_max"} <= set(tags)
    exact = "^(" + "|".join(re.escape(t) for t in tags) + ")$"
    assert view.matching(page["driver"], exact) == len(tags)
    assert view.matching(page["driver"], "^(loss/loss|no/such_tag)$") == 1
