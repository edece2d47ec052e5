"""Cache keys of pretrained models (opd/models/factory.py)."""
from __future__ import annotations

import hashlib
import shutil

from opd.config.schema import load_config
from opd.config.files import config_hash
from opd.models.factory import pretrain_key
from opd.data.splits import data_paths


def test_pretrain_key_names_the_data_by_content(digits_dir, tmp_path):
    """The same data in another directory (another checkout) gives the same key, so a model
    pretrained there is found in the cache; one changed byte gives another key."""
    copy = tmp_path / "digits"
    shutil.copytree(digits_dir, copy)
    a = load_config("tiny", [f"data.data_dir={digits_dir}"])
    b = load_config("tiny", [f"data.data_dir={copy}"])
    train_a, train_b = data_paths(a)[0], data_paths(b)[0]
    key_a, key_b = pretrain_key(a, "teacher", train_a), pretrain_key(b, "teacher", train_b)
    assert key_a["data"] == hashlib.sha256(train_a.read_bytes()).hexdigest()
    assert config_hash(key_a) == config_hash(key_b)
    with train_b.open("ab") as f:
        f.write(b"\0")
    assert config_hash(pretrain_key(b, "teacher", train_b)) != config_hash(key_a)
