"""The ``mm3lab`` command: ``info``, ``tour``, ``lab`` and the text explainers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_info(args) -> int:
    from . import info

    data = info()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        width = max(len(k) for k in data)
        for key, value in data.items():
            if isinstance(value, list) and value:
                print(f"{key:<{width}}  {value[0]}")
                for item in value[1:]:
                    print(f"{'':<{width}}  {item}")
            else:
                print(f"{key:<{width}}  {value}")
    return 0


def _cmd_tour(args) -> int:
    from .tour import TourError, TourInterrupted, repeat_report, repeat_tour, run_tour

    notebooks = Path(args.notebooks) if args.notebooks else None
    try:
        if args.repeat:
            tours = repeat_tour(
                args.repeat,
                notebooks_dir=notebooks,
                only=args.only,
                timeout=args.timeout,
                sliced_poll=not args.stock_client,
            )
            print(repeat_report(tours))
            return 1 if any(r.error for t in tours for r in t) else 0
        out = run_tour(notebooks_dir=notebooks, out_dir=Path(args.out), only=args.only, timeout=args.timeout)
    except TourError as e:
        print(f"tour failed: {e}", file=sys.stderr)
        return 1
    except TourInterrupted as e:
        print(f"tour interrupted: {e}", file=sys.stderr)
        return 130
    print(f"tour written to {out.resolve()} (open index.html)")
    return 0


def _cmd_lab(args) -> int:
    import subprocess

    from .tour import find_notebooks_dir

    nb_dir = Path(args.notebooks) if args.notebooks else find_notebooks_dir()
    cmd = [sys.executable, "-m", "jupyterlab", f"--notebook-dir={nb_dir}", *args.extra]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mm3lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, device and the kernel backend in force")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_info)

    from .tour import CELL_TIMEOUT_S

    p = sub.add_parser("tour", help="execute every notebook headless; write HTML and PNG figures")
    p.add_argument("--out", default="mm3lab-tour", help="output folder (default: ./mm3lab-tour)")
    p.add_argument("--notebooks", default=None, help="notebook folder (default: the checkout's notebooks/)")
    p.add_argument("--only", nargs="*", default=None, help="run only notebooks whose name contains one of these")
    p.add_argument(
        "--timeout",
        type=int,
        default=CELL_TIMEOUT_S,
        help=f"seconds allowed per cell; past it the tour fails (default {CELL_TIMEOUT_S})",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=0,
        metavar="N",
        help="stress run: execute the notebooks N times (no HTML) and print per-notebook "
        "min/median/max seconds and the longest cell",
    )
    p.add_argument(
        "--stock-client",
        action="store_true",
        help="with --repeat: use nbclient's stock kernel client (to compare; it can miss a reply "
        "until the cell timeout)",
    )
    p.set_defaults(func=_cmd_tour)

    p = sub.add_parser("lab", help="open JupyterLab on the notebooks")
    p.add_argument("--notebooks", default=None)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="passed on to jupyter lab")
    p.set_defaults(func=_cmd_lab)

    # --- text explainers (one add_parser per topic) ---
    from .explain import add_explain_parser

    add_explain_parser(sub)  # mm3lab explain: one sparse block table row, its pages and ctx (SPEC section 3)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
