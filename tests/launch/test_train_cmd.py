"""`opd train` refuses bad input before anything starts: missing files, a used run directory."""
import pytest

from launch.cli import main
from opd.config.schema import load_config
from opd.run.preflight import missing_inputs


@pytest.mark.parametrize("preset", ["llamagen_b_gkd", "llamagen_l_gkd", "llamagen_b_varkd",
                                    "llamagen_l_varkd"])
def test_paper_presets_name_missing_checkpoints(preset, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", preset, f"run.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opd: error: model.student_ckpt=checkpoints/llamagen/c2i_")
    assert "model.teacher_ckpt=checkpoints/llamagen/c2i_XL_384.pt does not exist" in err
    assert "\n" not in err
    assert not (tmp_path / "run").exists()                    # nothing was started or written


def test_present_checkpoints_pass_the_preflight(tmp_path):
    for name in ("s.pt", "t.pt"):
        (tmp_path / name).write_bytes(b"x")
    cfg = load_config(None, [f"model.student_ckpt={tmp_path}/s.pt",
                             f"model.teacher_ckpt={tmp_path}/t.pt"])
    assert missing_inputs(cfg) == []
    cfg = load_config(None, [f"model.student_ckpt={tmp_path}/nope.pt"])
    assert missing_inputs(cfg) == [f"model.student_ckpt={tmp_path}/nope.pt does not exist; "
                                   "download the LlamaGen c2i_*.pt file there, or set the key "
                                   "to null to pretrain a student on the configured data"]


def test_used_run_directory_is_refused_by_the_command(tmp_path, capsys):
    (tmp_path / "metrics.parquet").write_bytes(b"old results")
    assert main(["train", "--config", "tiny", f"run.dir={tmp_path}", "run.mode=reference"]) == 2
    err = capsys.readouterr().err
    assert f"run directory {tmp_path} is not empty" in err and "--resume" in err
    assert (tmp_path / "metrics.parquet").read_bytes() == b"old results"


def test_tracking_that_cannot_measure_the_data_is_refused():
    from opd.config.loader import ConfigError
    from opd.run.preflight import check_tracking
    cfg = load_config(None, ["data.dataset=parquet"])
    with pytest.raises(ConfigError, match="eval.extractor='digits-cnn' only measures the digits") as e:
        check_tracking(cfg)
    assert e.value.key == "eval.extractor" and "eval.track=false" in str(e.value)
    check_tracking(load_config(None, ["data.dataset=parquet", "eval.track=false"]))
    with pytest.raises(ConfigError, match="eval.num_samples=3") as e:
        check_tracking(load_config("tiny", ["eval.num_samples=3"]))
    check_tracking(load_config("tiny"))
