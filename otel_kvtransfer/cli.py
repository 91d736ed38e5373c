"""The `otel-kvtransfer` command: `demo`, and the span-file tools `timeline` and `summarize`."""

import argparse
import sys


def _demo(args) -> int:
    # pylint: disable=import-outside-toplevel
    from otel_kvtransfer import demo
    from otel_kvtransfer.loopback import MooncakeUnavailable

    cfg = demo.config_from_args(args)
    try:
        summary = demo.run(cfg)
    except MooncakeUnavailable as exc:
        print(f"otel-kvtransfer demo: {exc}", file=sys.stderr)
        return 2
    print(summary["table"])
    print(f"bytes verified on every decode engine: {'yes' if summary['bytes_verified'] else 'NO'}")
    print(f"spans: {summary['span_file']}")
    for line in summary.get("next_steps", []):
        print(line)
    return 0 if summary["bytes_verified"] else 1


def build_parser() -> argparse.ArgumentParser:
    from otel_kvtransfer import demo  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(prog="otel-kvtransfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser("demo", help="prefill -> decode KV transfers over real Mooncake on 127.0.0.1")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=_demo)
    try:
        from otel_kvtransfer import report_cli  # pylint: disable=import-outside-toplevel
    except ImportError:
        report_cli = None
    if report_cli is not None:
        report_cli.add_subcommands(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
