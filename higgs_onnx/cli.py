"""What every command shares: logging setup and turning errors into one clear line and an exit code.

Exit codes: 0 success, 1 runtime failure (an output that could not be written: the message says where the audio
was kept), 2 usage error (bad arguments, missing or invalid inputs, a request that breaks the contract, a package
of an extra not installed: `extras`, an execution provider this machine's runtime lacks or would not run a part
on: `ProviderError`, a user cache that cannot be written: `user_cache.CacheError`), 130 Ctrl-C.
The full traceback is printed only with `--log-level DEBUG` (or LOG_LEVEL=DEBUG).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from .extras import as_missing
from .generation.contract import NoAudioError
from .outputs import OutputError
from .runtime.checks import ProviderError

USAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                PermissionError, ProviderError)


def add_log_level(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "WARNING").upper(),
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default: $LOG_LEVEL or WARNING")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level), format="%(levelname)s %(name)s: %(message)s")


def one_line_errors(ap: argparse.ArgumentParser) -> None:
    """argparse's usage errors as one line (not the whole usage block), exit 2 as before."""
    def error(message: str):
        print(f"error: {message} (see {ap.prog} --help)", file=sys.stderr)
        sys.exit(2)

    ap.error = error


def run_main(fn: Callable[[argparse.Namespace], int], ap: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse, set up logging, call `fn(args)`; errors become one line on stderr and a non-zero exit."""
    one_line_errors(ap)
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    debug = args.log_level == "DEBUG"
    try:
        return fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USAGE_ERRORS as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OutputError, NoAudioError) as e:  # failures at the end whose message already says all
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the one place that turns any failure into a clear line
        if debug:
            raise
        extra = as_missing(e)  # a package an extra installs is missing: which extra, in one line (exit 2)
        if extra is not None:
            print(extra.line(), file=sys.stderr)
            return 2
        print(f"error: {type(e).__name__}: {e} (rerun with --log-level DEBUG for the full trace)", file=sys.stderr)
        return 1
