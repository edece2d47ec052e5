"""The GPT: cached decoding equals the uncached forward (invariant 4), LlamaGen shapes."""
import pytest
import torch

from opd.models import GPT, create_model, preset_args


def random_model(preset="GPT-tiny", **kw) -> GPT:
    torch.manual_seed(0)
    m = create_model(preset, **kw).double().eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


@pytest.fixture(scope="module")
def model():
    return random_model()


def data(m, B, seed=1):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, m.num_classes, (B,), generator=g)
    tokens = torch.randint(0, m.vocab_size, (B, m.block_size), generator=g)
    return labels, tokens


def test_rows_at_different_positions_match_uncached(model):
    B, T = 4, model.block_size
    labels, tokens = data(model, B)
    ref = model(labels, tokens[:, : T - 1])                  # (B, T, V)
    model.setup_cache(B, T + 1)
    prefix = [0, 3, 5, 9]                                    # every row starts elsewhere
    for b, p in enumerate(prefix):
        out = model.prefill(labels[b:b + 1], tokens[b:b + 1, :p], torch.tensor([b]))
        torch.testing.assert_close(out, ref[b:b + 1, : p + 1], rtol=1e-12, atol=1e-12)
    # one batched forward, each row 3 tokens ahead from its own position
    pos = torch.tensor(prefix)[:, None] + torch.arange(1, 4)
    toks = torch.gather(tokens, 1, pos - 1)
    out = model.forward_cached(toks, pos, torch.arange(B))
    torch.testing.assert_close(out, torch.gather(ref, 1, pos[..., None].expand(-1, -1, ref.shape[-1])),
                               rtol=1e-12, atol=1e-12)


def test_subset_of_physical_rows_and_stale_entries(model):
    B, T = 3, model.block_size
    labels, tokens = data(model, B, seed=2)
    ref = model(labels, tokens[:, : T - 1])
    model.setup_cache(8, T + 1)
    rows = torch.tensor([6, 1, 3])
    model.prefill(labels, tokens[:, :4], rows)
    # write garbage drafts at positions 5..8 of every row, then rewrite from position 5
    junk = torch.randint(0, model.vocab_size, (B, 4))
    model.forward_cached(junk, torch.arange(5, 9).expand(B, -1), rows)
    # only rows 1 and 3 (logical images 1, 2) advance: Compact execution
    sub = torch.tensor([1, 2])
    pos = torch.arange(5, 8).expand(2, -1)
    out = model.forward_cached(tokens[sub, 4:7], pos, rows[sub])
    torch.testing.assert_close(out, ref[sub, 5:8], rtol=1e-12, atol=1e-12)
    # rows=None is rows 0..B-1 (Full execution)
    model.setup_cache(B, T + 1)
    model.prefill(labels, tokens[:, :2], None)
    out = model.forward_cached(tokens[:, 2:6], torch.arange(3, 7).expand(B, -1), None)
    torch.testing.assert_close(out, ref[:, 3:7], rtol=1e-12, atol=1e-12)


def test_cfg_row_pairs_share_positions(model):
    B, T = 2, model.block_size
    labels, tokens = data(model, B, seed=3)
    null = torch.full_like(labels, model.num_classes)
    ref_c = model(labels, tokens[:, :T - 1])
    ref_u = model(null, tokens[:, :T - 1])
    model.setup_cache(2 * B, T + 1)
    both = torch.cat([labels, null])
    prefix = torch.cat([tokens[:, :5], tokens[:, :5]])
    model.prefill(both, prefix, None)
    out = model.forward_cached(torch.cat([tokens[:, 5:6]] * 2), torch.full((2 * B, 1), 6), None)
    torch.testing.assert_close(out[:B], ref_c[:, 6:7], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[B:], ref_u[:, 6:7], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out[:B], out[B:])


def test_gqa_and_float32_cache():
    m = random_model(n_kv_head=1).float()
    labels, tokens = data(m, 2, seed=4)
    ref = m(labels, tokens[:, :10])
    m.setup_cache(2, m.block_size + 1)
    m.prefill(labels, tokens[:, :6], None)
    out = m.forward_cached(tokens[:, 6:10], torch.arange(7, 11).expand(2, -1), None)
    torch.testing.assert_close(out, ref[:, 7:11], rtol=1e-4, atol=1e-4)


def test_label_dropout_only_in_train_mode():
    m = random_model(class_dropout_prob=1.0)
    labels, tokens = data(m, 2, seed=5)
    null = torch.full_like(labels, m.num_classes)
    m.eval()
    assert not torch.allclose(m(labels, tokens[:, :3]), m(null, tokens[:, :3]))
    m.train()
    torch.testing.assert_close(m(labels, tokens[:, :3]), m.eval()(null, tokens[:, :3]))


def test_rope_class_slot_is_zero_and_2d():
    m = random_model()
    table = m._rope64
    assert table.shape == (1 + m.block_size, m.args.head_dim // 2, 2)
    assert table[0].abs().max() == 0
    g, quarter = m.grid_size, m.args.head_dim // 4
    # tokens in the same grid row share the first half of the rotary pairs, same column the second
    assert torch.equal(table[1, :quarter], table[2, :quarter])
    assert torch.equal(table[1, quarter:], table[1 + g, quarter:])
    assert not torch.equal(table[1, quarter:], table[2, quarter:])


@pytest.mark.parametrize("preset,hidden,params_m", [("GPT-B", 2048, 111), ("GPT-L", 2816, 343)])
def test_llamagen_presets(preset, hidden, params_m):
    args = preset_args(preset)
    assert args.ffn_hidden == hidden and args.head_dim == 64
    if preset == "GPT-B":
        n = sum(p.numel() for p in create_model(preset).parameters())
        assert round(n / 1e6) == params_m


def test_bad_preset_and_override():
    with pytest.raises(ValueError, match="did you mean 'GPT-B'"):
        create_model("GPT-b")
    with pytest.raises(ValueError, match="unknown model argument"):
        create_model("GPT-tiny", heads=3)
    with pytest.raises(ValueError, match="block_size"):
        random_model()(torch.tensor([0]), torch.zeros(1, 17, dtype=torch.long))


def test_token_tree_forward_and_moved_slots_match_uncached(model):
    """A tree window (rollout/candidates.py): root, a 3-column branch and two 1-column branches
    at the root's next position, each column equal to the uncached forward of its own path; the
    winning branch's slot moved into place gives later forwards the uncached logits."""
    B, T = 2, model.block_size
    labels, tokens = data(model, B, seed=6)
    model.setup_cache(B, T + 3)                          # 2 scratch slots past T + 1
    model.prefill(labels, tokens[:, :4], None)             # positions 0..4
    x, y = (tokens[:, 4:5] + 1) % model.vocab_size, (tokens[:, 4:5] + 2) % model.vocab_size
    window = torch.cat([tokens[:, 3:7], x, y], 1)        # root = token 3 at position 4
    positions = torch.tensor([4, 5, 6, 7, 5, 5]).expand(B, -1)
    col = torch.arange(6)
    branch = torch.tensor([-1, 0, 0, 0, 1, 2])
    tree = (col[None] == 0) | ((branch[:, None] == branch[None]) & (col[None] <= col[:, None]))
    out = model.forward_cached(window, positions, None, tree.expand(B, -1, -1))
    ref = model(labels, tokens[:, :7])
    torch.testing.assert_close(out[:, :4], ref[:, 4:8], rtol=1e-12, atol=1e-12)
    for c, alt in ((4, x), (5, y)):
        ref_alt = model(labels, torch.cat([tokens[:, :4], alt], 1))
        torch.testing.assert_close(out[:, c], ref_alt[:, 5], rtol=1e-12, atol=1e-12)
    # branch 2 (y) wins: its slot 4 + 5 goes to slot 5, then decoding goes on from y
    model.move_cached(None, torch.full((B, 1), 9), torch.full((B, 1), 5))
    nxt = tokens[:, 8:10]
    out = model.forward_cached(nxt, torch.tensor([6, 7]).expand(B, -1), None)
    ref_y = model(labels, torch.cat([tokens[:, :4], y, nxt], 1))
    torch.testing.assert_close(out, ref_y[:, 6:8], rtol=1e-12, atol=1e-12)
