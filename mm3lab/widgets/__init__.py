"""Interactive views for the notebooks (ipywidgets), one module per topic.

Each widget wraps a plain function of the same topic that draws a figure and
prints a table; the notebooks show both, and the tests drive the widget's
callback through ``ipywidgets.interactive`` without a frontend. ipywidgets is
imported only here, so the rest of mm3lab runs without it.
"""
