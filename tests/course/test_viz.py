"""paged_course.viz: each picture is a Figure with the expected parts; explorer actions."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from paged_course import viz  # noqa: E402
from paged_ref import KVCacheManager
from tests.conftest import need


def _gids(fig: Figure, prefix: str) -> list[str]:
    return [a.get_gid() for a in fig.findobj() if (a.get_gid() or "").startswith(prefix)]


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]


@pytest.fixture
def manager():
    m = KVCacheManager(num_blocks=12, block_size=4)
    m.add_sequence("a", 6)   # blocks 0, 1 (second half full)
    m.add_sequence("b", 4)   # block 2, full
    m.add_sequence("c", 1)   # block 3, one token
    return m


def test_draw_block_tables_parts(manager):
    fig = viz.draw_block_tables(manager, title="demo")
    assert isinstance(fig, Figure)
    assert len(_gids(fig, "pool:")) == 12
    assert sorted(_gids(fig, "logical:")) == ["logical:a:0", "logical:a:1", "logical:b:0",
                                            "logical:c:0"]
    texts = _texts(fig)
    assert sum("free" in t for t in texts if t[0].isdigit()) == 8
    assert "1: 2/4" in texts and "3: 1/4" in texts and "2: 4/4" in texts
    title = fig._suptitle.get_text()
    assert "demo" in title and "4 of 12 blocks used, 8 free" in title
    assert "11 tokens" in title and "5 slots reserved but empty" in title
    # one arrow per used block
    assert len(fig.artists) == 4


def test_draw_block_tables_empty_and_big_pool():
    fig = viz.draw_block_tables(KVCacheManager(64, 16))
    assert len(_gids(fig, "pool:")) == 64
    assert "0 of 64 blocks used" in fig._suptitle.get_text()


def test_draw_contiguous_vs_paged_totals():
    fig = viz.draw_contiguous_vs_paged([7, 3, 12], max_len=16, block_size=4)
    assert isinstance(fig, Figure)
    assert len(_gids(fig, "paged:")) == 2 + 1 + 3
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert "22 of 48 reserved slots hold tokens (46%)" in titles[0]
    assert "22 of 24 reserved slots hold tokens (92%)" in titles[1]
    assert {"7/16", "3/16", "12/16", "7/8", "3/4", "12/12"} <= set(_texts(fig))
    with pytest.raises(ValueError):
        viz.draw_contiguous_vs_paged([20], max_len=16, block_size=4)


def test_draw_token_lookup():
    fig = viz.draw_token_lookup([5, 2, 7], seq_len=11, block_size=4, token=9)
    assert isinstance(fig, Figure)
    title = fig._suptitle.get_text()
    assert "block_table[2] = 7" in title and "= 29" in title
    with pytest.raises(ValueError):
        viz.draw_token_lookup([5, 2, 7], seq_len=11, block_size=4, token=11)
    with pytest.raises(ValueError):
        viz.draw_token_lookup([5], seq_len=11, block_size=4, token=1)


def test_draw_masked_programs_counts_programs_and_masked_lanes():
    fig = viz.draw_masked_programs(20, 8)
    assert [t for t in _texts(fig) if t.startswith("program")] == [f"program {i}" for i in range(3)]
    hatched = [a for a in fig.axes[0].patches if a.get_hatch()]
    assert len(hatched) == 3 * 8 - 20


def test_draw_program_walk_follows_only_used_table_entries():
    from paged_course.testing import make_paged_inputs

    inp = make_paged_inputs([11, 19, 6, 14], num_q_heads=8, num_kv_heads=2, head_dim=16,
                            block_size=4, seed=4)
    fig = viz.draw_program_walk(inp, b=1, h=0, tile=8)
    ax_grid, ax_walk = fig.axes
    assert len(ax_grid.patches) == 4 * 2  # one box per program of the grid
    arrows = fig.findobj(matplotlib.patches.ConnectionPatch)
    assert len(arrows) == 5  # one arrow per used block: ceil(19 / 4)
    texts = _texts(fig)
    assert [t for t in texts if t.startswith("loop step")] == [
        "loop step 0: tokens 0-7", "loop step 1: tokens 8-15", "loop step 2: tokens 16-23"]
    used = inp.block_tables[1, :5].tolist()
    assert all(str(b) in texts for b in used)


def test_draw_sm_occupancy_counts_busy_sms():
    fig = Figure()
    ax = fig.subplots()
    viz.draw_sm_occupancy(ax, programs=8, num_sms=132, programs_per_sm=4, title="one pass")
    assert len(ax.patches) == 132
    assert "8 of 132 SMs busy" in ax.get_title()
    viz.draw_sm_occupancy(ax, programs=10_000, num_sms=132, programs_per_sm=4, title="split")
    assert "132 of 132 SMs busy" in ax.get_title()


def test_draw_decode_trace_marks_the_steps_that_take_a_block():
    from types import SimpleNamespace

    trace = SimpleNamespace(max_diff=[0.0, 1e-7, 2e-7, 1e-7], free_blocks=[6, 6, 5, 5],
                            num_blocks=8)
    fig = viz.draw_decode_trace(trace, prompt_lens=[3], block_size=4)
    crosses = [line for line in fig.axes[1].get_lines() if line.get_marker() == "x"]
    assert [list(c.get_xdata()) for c in crosses] == [[2]]  # token 4 starts block 1 at step 2
    assert list(crosses[0].get_ydata()) == [3]


def test_seq_color_is_stable_and_not_grey():
    assert viz.seq_color(3) == viz.seq_color(3)
    assert viz.seq_color("x") == viz.seq_color("x")
    assert all(viz.seq_color(i) != matplotlib.colormaps["tab10"].colors[7] for i in range(20))


def _state(m: KVCacheManager):
    return {s: (m.block_table(s), m.seq_len(s)) for s in m.seq_ids}, m.num_free_blocks


def test_explorer_actions_change_the_manager():
    e = viz.BlockTableExplorer(num_blocks=8, block_size=4, prompts=(6, 3))
    m = e.manager
    assert m.seq_ids == [0, 1] and m.num_free_blocks == 5
    assert e.add_token(1) and m.seq_len(1) == 4 and m.num_free_blocks == 5
    assert e.add_token(1) and m.seq_len(1) == 5 and m.num_free_blocks == 4
    assert e.add_tokens(0, 3) and m.seq_len(0) == 9
    assert e.step() and (m.seq_len(0), m.seq_len(1)) == (10, 6)
    new = e.start(5)
    assert new == 2 and m.seq_len(2) == 5
    assert e.finish(0) and 0 not in m
    assert not e.finish(0) and "no request" in e.message
    assert isinstance(e.figure(), Figure)
    e.reset()
    assert e.manager.seq_ids == [0, 1] and e.manager.seq_len(0) == 6


def test_explorer_out_of_blocks_changes_nothing():
    e = viz.BlockTableExplorer(num_blocks=4, block_size=4, prompts=(8, 4))
    before = _state(e.manager)  # 3 blocks used, 1 free
    assert not e.add_tokens(1, 9)  # needs 3 new blocks
    assert "OUT OF BLOCKS" in e.message
    assert _state(e.manager) == before
    assert e.start(4) == 2          # takes the last block
    before = _state(e.manager)
    assert not e.add_token(1) and "OUT OF BLOCKS" in e.message
    assert e.start(1) is None and "cannot start" in e.message
    assert not e.step() and "OUT OF BLOCKS" in e.message
    assert _state(e.manager) == before
    assert not e.add_tokens(0, 0)
    assert _state(e.manager) == before


def test_explorer_widget_builds_and_buttons_work():
    need("ipywidgets", "the explorer's app")
    e = viz.BlockTableExplorer(num_blocks=8, block_size=4, prompts=(2,))
    w = e.widget
    buttons = {b.description: b for box in w.children[:2] for b in box.children
               if hasattr(b, "on_click")}
    assert e._request.options == ((("req 0", 0)),)
    buttons["+1 token"].click()
    assert e.manager.seq_len(0) == 3
    buttons["start new request"].click()
    assert e.manager.seq_ids == [0, 1]
    assert [label for label, _ in e._request.options] == ["req 0", "req 1"]
    buttons["finish"].click()  # the dropdown still points at req 0
    assert e.manager.seq_ids == [1]
    assert "finished req 0" in e._status.value


def test_explorer_number_boxes_fit_five_digits():
    # Issue 8, item 9: with ipywidgets' default label width, a 120 px "N" box showed "200" as
    # "2". The label now takes only its text's width and the box is wide enough for 5 digits.
    need("ipywidgets", "the explorer's app")
    e = viz.BlockTableExplorer(num_blocks=8, block_size=4, prompts=(2,))
    e.widget  # noqa: B018 (builds the widgets)
    for box in (e._count, e._prompt):
        assert box.style.description_width == "initial"
        assert int(box.layout.width.removesuffix("px")) >= 150
    e._count.value = 200
    assert e.add_tokens(0, e._count.value) is False  # 200 tokens do not fit in 8 blocks of 4
    assert "needs 50 new block(s)" in e.message


def test_draw_memory_shares_stacks_to_the_whole_pool():
    from paged_course import simulate

    req = simulate.sample_requests(60, seed=0, max_len=256)
    results = simulate.compare_strategies(req, capacity_slots=1024, block_size=16)
    fig = viz.draw_memory_shares(results, paper=simulate.PAPER_TOKEN_SHARE)
    bars = fig.axes[0].patches
    assert len(bars) == 4 * len(results)
    tops = {}
    for bar in bars:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    assert all(abs(top - 100) < 1e-6 for top in tops.values())
    assert sum(t.startswith("paper ") for t in _texts(fig)) == len(results)
