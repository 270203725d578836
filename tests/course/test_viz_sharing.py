"""Lesson 07 pictures: shared blocks, copy-on-write arrows, the prefix tree; SharingExplorer."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from paged_course import viz  # noqa: E402
from paged_ref import KVCacheManager  # noqa: E402
from tests.conftest import need  # noqa: E402


def _gids(fig, prefix):
    return sorted(a.get_gid() for a in fig.findobj() if (a.get_gid() or "").startswith(prefix))


def _texts(fig):
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]


def test_shared_blocks_show_ref_counts_copies_and_cached_blocks():
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3])  # blocks 0 (cached), 1
    m.fork("a", "b")
    m.append_slot("b", 4)  # copy-on-write 1 -> 2
    copies = m.take_copies()
    m.add_sequence("c", token_ids=[7, 8, 9])  # blocks 3 (cached), 4
    m.free_sequence("c")  # 3 evictable, 4 free
    fig = viz.draw_shared_blocks(m, copies=copies, title="demo")
    assert isinstance(fig, Figure)
    assert _gids(fig, "copy:") == ["copy:1:2"]
    assert len(_gids(fig, "pool:")) == 8
    texts = _texts(fig)
    assert "0: 2/2 ×2" in texts and "→0 ×2" in texts
    assert "3: cached, evict 1st" in texts and "4: free" in texts
    title = fig._suptitle.get_text()
    assert "demo" in title and "(1 shared)" in title and "1 cached & evictable" in title


def test_prefix_tree_nodes_and_edges():
    m = KVCacheManager(12, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5])  # cached: [1 2] -> [3 4]
    m.add_sequence("b", token_ids=[1, 2, 6, 6, 5])  # shares [1 2], adds [6 6]
    m.free_sequence("a")
    fig = viz.draw_prefix_tree(m)
    assert _gids(fig, "node:") == ["node:0", "node:1", "node:3"]
    texts = " ".join(_texts(fig))
    assert "[1 2]" in texts and "×1" in texts and "evict 1st" in texts
    assert "3 blocks (2 held, 1 evictable)" in fig._suptitle.get_text()
    empty = viz.draw_prefix_tree(KVCacheManager(4, 2))
    assert "prefix caching is off" in " ".join(_texts(empty))


def test_sharing_explorer_actions_without_a_display():
    ex = viz.SharingExplorer(num_blocks=12, block_size=4, system_prompt_len=8)
    assert ex.ask(3) == 0 and "0 found in the prefix cache" in ex.message
    assert ex.ask(2) == 1 and "8 found in the prefix cache" in ex.message
    assert ex.fork(0) == 2 and "shared, no K/V copied; holders now [3, 3, 2]" in ex.message
    assert ex.add_token(2) and "copy-on-write [(2," in ex.message
    assert ex.step() and ex.finish(1) and "stay cached" in ex.message
    assert "lost a holder (now [2, 2, 0])" in ex.message and not ex.finish(1)
    assert ex.fork(99) is None and ex.message == "no request 99"
    assert not ex.add_tokens(0, 1000) and ex.message.startswith("OUT OF BLOCKS")
    fig = ex.figure()
    assert _gids(fig, "node:") and _gids(fig, "logical:")
    ex.reset()
    assert len(ex.manager) == 0 and ex.manager.cached_blocks() == []


def test_sharing_explorer_widget_has_the_sharing_row():
    need("ipywidgets", "the explorer's app")
    ex = viz.SharingExplorer(num_blocks=8, block_size=4)
    labels = [b.description for row in ex.widget.children[:3]
              for b in getattr(row, "children", ()) if hasattr(b, "on_click")]
    assert "fork (one more sample)" in labels and "ask: system prompt + N tokens" in labels
    ex.ask(2)
    assert ex._request.options  # the dropdown follows the requests
