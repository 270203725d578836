"""The explorer shows its live widget in JupyterLab and a PNG everywhere else (GitHub, nbconvert,
a notebook saved without widget state): both are in the one output it displays."""

from __future__ import annotations

from paged_course import viz
from tests.conftest import need


def test_explorer_output_carries_the_widget_and_a_picture(monkeypatch):
    need("ipywidgets", "the explorer's app")
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda obj, raw=False: shown.append((obj, raw)))
    explorer = viz.BlockTableExplorer(num_blocks=8, block_size=4, prompts=(3, 5))
    explorer._ipython_display_()
    [bundle] = [obj for obj, raw in shown if raw]  # (the widget's own Output shows an Image)
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["image/png"].startswith(b"\x89PNG")
    first = bundle["image/png"]
    explorer.add_tokens(0, 2)
    shown.clear()
    explorer._ipython_display_()
    [bundle] = [obj for obj, raw in shown if raw]
    assert bundle["image/png"] != first, "the PNG shows the current state"


def test_step_slider_output_carries_a_picture_not_a_placeholder(monkeypatch):
    """Lesson 09's step slider: a saved notebook shows the picture of the step it shows, not
    "(an interactive widget ...)" (tools/execute_notebooks.py drops the widget part)."""
    need("ipywidgets", "the explorer's app")
    from types import SimpleNamespace

    import IPython.display

    from paged_course.engine_view import StepRecorder

    rec = StepRecorder()
    for step in range(3):
        rec(SimpleNamespace(step=step, num_blocks=8, block_size=4, ran=[(0, 0, 1)],
                            num_tokens=1, admitted=[], preempted=[], finished=[],
                            cached_tokens=0, block_tables={0: [5, 2][: 1 + step // 2]},
                            seq_lens={0: 3 + step}, num_free_blocks=7))
    shown = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda obj, raw=False: shown.append((obj, raw)))
    rec.widget()._ipython_display_()
    [bundle] = [obj for obj, raw in shown if raw]
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["image/png"].startswith(b"\x89PNG")
    assert bundle["text/plain"] == "StepRecorder: 3 steps"
