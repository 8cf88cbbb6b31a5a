"""``mm3lab tour``: execute every notebook headless and write it as HTML, figures as PNG.

Output layout (``out_dir``)::

    index.html                      links to every notebook
    01_block_selection.html         the executed notebook
    01_block_selection/figure-03-1.png   every PNG output: cell 3, first image
    ...
"""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent


def find_notebooks_dir() -> Path:
    """The ``notebooks/`` folder of the checkout this package runs from."""
    candidates = [PACKAGE_ROOT.parent / "notebooks", Path.cwd() / "notebooks"]
    for c in candidates:
        if c.is_dir() and any(c.glob("*.ipynb")):
            return c
    raise FileNotFoundError(
        "no notebooks/ folder found next to the package or in the current folder; "
        "run from a clone of mm3lab or pass --notebooks DIR"
    )


def _figures(nb) -> list[tuple[str, bytes]]:
    figures = []
    for i, cell in enumerate(nb.cells):
        n = 0
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                n += 1
                figures.append((f"figure-{i:02d}-{n}.png", base64.b64decode(data["image/png"])))
    return figures


def run_tour(
    notebooks_dir: Path | None = None,
    out_dir: Path = Path("mm3lab-tour"),
    only: list[str] | None = None,
    timeout: int = 900,
    progress: bool = True,
) -> Path:
    """Execute the notebooks on the default backend; return the output folder."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter
    from tqdm.auto import tqdm

    nb_dir = notebooks_dir or find_notebooks_dir()
    paths = sorted(nb_dir.glob("*.ipynb"))
    if only:
        paths = [p for p in paths if any(s in p.name for s in only)]
    if not paths:
        raise FileNotFoundError(f"no notebooks to run in {nb_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter()
    rows = []
    env_backup = os.environ.get("MPLBACKEND")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    try:
        bar = tqdm(paths, desc="tour", unit="notebook", disable=not progress)
        for path in bar:
            bar.set_postfix_str(path.name)
            nb = nbformat.read(path, as_version=4)
            resources = {"metadata": {"path": str(nb_dir)}}
            NotebookClient(nb, timeout=timeout, kernel_name="python3", resources=resources).execute()
            body, _ = exporter.from_notebook_node(nb)
            (out_dir / f"{path.stem}.html").write_text(body, encoding="utf-8")
            figs = _figures(nb)
            if figs:
                fig_dir = out_dir / path.stem
                fig_dir.mkdir(exist_ok=True)
                for name, data in figs:
                    (fig_dir / name).write_bytes(data)
            rows.append((path.stem, len(figs)))
    finally:
        if env_backup is None:
            os.environ.pop("MPLBACKEND", None)
    items = "\n".join(
        f'<li><a href="{html.escape(stem)}.html">{html.escape(stem)}</a> ({n} figures)</li>' for stem, n in rows
    )
    (out_dir / "index.html").write_text(
        f"<!doctype html><title>mm3lab tour</title><h1>mm3lab tour</h1><ul>\n{items}\n</ul>\n", encoding="utf-8"
    )
    return out_dir
