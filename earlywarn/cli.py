"""``earlywarn`` command line: ``analyze`` logged runs, ``calibrate`` thresholds on healthy runs.

Every problem with the input is one line on stderr (``earlywarn: error: ...``) and exit status 2;
never a traceback (set ``EARLYWARN_DEBUG=1`` to see one for an internal error, exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

EXIT_USAGE = 2
EXIT_INTERNAL = 1


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise _UsageError(message)


def _pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise _UsageError(f"{what} {item!r}: use NAME=VALUE")
        out[name.strip()] = value.strip()
    return out


def _build_parser() -> _Parser:
    # Help is built from the names the code accepts, so it cannot drift from them.
    from earlywarn.analyze import BASELINE_KEYS
    from earlywarn.analyze.hygiene import KEY_MAP_NAMES
    from earlywarn.analyze.readers import SOURCE_FORMS

    p = _Parser(prog="earlywarn", description="earlywarn: keep training runs alive; analyse logged runs offline.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", metavar="FILE", help="detector config JSON (DetectorConfig.to_file / earlywarn calibrate)")
        sp.add_argument("--key", action="append", metavar="NAME=COLUMN",
                        help=f"read NAME from COLUMN (NAME: {', '.join(KEY_MAP_NAMES)}); repeat as needed, "
                             "e.g. --key loss=train/loss --key step=iteration")
        sp.add_argument("--baseline", action="append", metavar="NAME=VALUE",
                        help=f"typical value known ahead (NAME: {', '.join(BASELINE_KEYS)} or grad_norm/<layer>), "
                             "e.g. --baseline grad_norm=0.2 --baseline loss=2.3")

    a = sub.add_parser(
        "analyze", help="replay the detector over logged runs",
        description="Replay earlywarn's detector over runs that are already logged.\n\nSOURCE forms:\n" + SOURCE_FORMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("sources", nargs="+", metavar="SOURCE")
    a.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/analyze.md)")
    a.add_argument("--plot", metavar="OUT.png", help="write a PNG of loss and grad norm with alerts marked (needs matplotlib)")
    a.add_argument("--run", metavar="TEXT", help="only the runs whose name contains TEXT")
    a.add_argument("--max-alerts", type=int, default=20, metavar="N", help="alerts listed per run in the text report (default 20)")
    a.add_argument("--fail-on", choices=("info", "warning", "critical"),
                   help="exit 1 when any run has an alert at or above this level (for CI)")
    common(a)

    c = sub.add_parser(
        "calibrate", help="choose thresholds meeting a false-alarm target on healthy runs",
        description="Pick detector thresholds that meet a false-alarm target on runs you mark healthy and write "
                    "them as a detector config file, which earlywarn.watch(model, optimizer, detector=FILE) and "
                    "`earlywarn analyze --config FILE` load.",
    )
    c.add_argument("sources", nargs="+", metavar="HEALTHY_RUN")
    c.add_argument("--target-rate", type=float, default=0.0, metavar="R",
                   help="false alarms (warnings or worse) allowed per 10,000 steps (default 0)")
    c.add_argument("--margin", type=int, default=1, metavar="N", help="settings this many notches stricter (on the sensitivity ladder) than the most sensitive "
                        "one that meets the target, so healthy runs are not on the edge (default 1)")
    c.add_argument("--out", "-o", default="earlywarn_detector.json", metavar="FILE",
                   help="where to write the config (default earlywarn_detector.json)")
    c.add_argument("--json", action="store_true", help="print the calibration result as JSON")
    common(c)
    return p


def _print_report(report, args) -> None:
    if args.json:
        from earlywarn.analyze.report import _json_safe

        print(json.dumps(_json_safe(report.to_dict()), indent=2, allow_nan=False))
        return
    use_rich = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    if use_rich:
        try:
            from rich.console import Console
        except ImportError:
            use_rich = False
    if use_rich:
        from earlywarn.analyze.report import render_rich

        render_rich(report, Console(), max_alerts=args.max_alerts)
    else:
        from earlywarn.analyze.report import render_text

        print(render_text(report, max_alerts=args.max_alerts))


def _cmd_analyze(args) -> int:
    from earlywarn.analyze import analyze, plot
    from earlywarn.events import Level

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise _UsageError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None
        parent = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(parent):
            raise _UsageError(f"--plot {args.plot}: directory {parent} does not exist")
    if args.max_alerts < 0:
        raise _UsageError("--max-alerts: use a number >= 0")
    report = analyze(
        args.sources, config=args.config, key_map=_pairs(args.key, "--key"),
        baseline=_pairs(args.baseline, "--baseline") or None, select=args.run,
    )
    _print_report(report, args)
    if args.plot:
        plot(report, args.plot)
        print(f"earlywarn: plot written to {args.plot}", file=sys.stderr)
    if args.fail_on:
        worst = max((r.max_level for r in report.runs), default=Level.NONE)
        if worst >= Level.parse(args.fail_on):
            return 1
    return 0


def _cmd_calibrate(args) -> int:
    from earlywarn.analyze import calibrate

    res = calibrate(
        args.sources, target_rate=args.target_rate, config=args.config, key_map=_pairs(args.key, "--key"),
        baseline=_pairs(args.baseline, "--baseline") or None, margin=args.margin, out=args.out,
    )
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print(f"calibrated on {len(res.runs)} healthy run(s), {res.steps} steps")
        for t in res.tried:
            mark = "  <- chosen" if t["sensitivity"] == res.sensitivity else ""
            print(f"  sensitivity {t['sensitivity']:<5} false alarms {t['false_alarms']:>4} "
                  f"({t['rate_per_10k']:.2f} per 10k steps){mark}")
        print(f"chosen sensitivity {res.sensitivity}: {res.false_alarms} false alarm(s), "
              f"target {res.target_rate:g} per 10k steps; config written to {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``earlywarn`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from earlywarn.analyze import AnalyzeError
    except Exception as e:  # pragma: no cover - a broken install
        print(f"earlywarn: error: cannot load earlywarn.analyze ({type(e).__name__}: {e})", file=sys.stderr)
        return EXIT_INTERNAL
    try:
        parser = _build_parser()
        args = parser.parse_args(argv)
        if args.version:
            from earlywarn import __version__

            print(f"earlywarn {__version__}")
            return 0
        if args.command is None:
            raise _UsageError("choose a command: analyze or calibrate (earlywarn --help)")
        if args.command == "analyze":
            return _cmd_analyze(args)
        return _cmd_calibrate(args)
    except _UsageError as e:
        msg = str(e)
    except AnalyzeError as e:
        msg = str(e)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        msg = f"{e.filename or ''}: {e.strerror}".lstrip(": ")
    except BrokenPipeError:  # `earlywarn analyze ... | head`
        return 0
    except KeyboardInterrupt:
        print("earlywarn: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help
        return int(e.code or 0) if isinstance(e.code, int) else 0
    except Exception as e:
        if os.environ.get("EARLYWARN_DEBUG"):
            raise
        text = " ".join(str(e).split()) or "no message"
        print(f"earlywarn: error: internal error: {type(e).__name__}: {text} "
              "(set EARLYWARN_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
    print(f"earlywarn: error: {' '.join(msg.split())}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
