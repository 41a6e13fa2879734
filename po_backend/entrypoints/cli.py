"""`prefillonly`: the command-line entry point (vLLM's `vllm serve MODEL` shape).

prefillonly serve MODEL [server flags]     # = python -m po_backend.entrypoints.launch_server --model-path MODEL ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = "usage: prefillonly serve MODEL [flags]   (prefillonly serve --help lists the flags)"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest = args[0], args[1:]
    if command != "serve":
        raise SystemExit(f"prefillonly: unknown command {command!r}\n{USAGE}")
    from po_backend.entrypoints.launch_server import main as serve

    if rest and not rest[0].startswith("-"):  # the model as a positional argument
        rest = ["--model-path", rest[0], *rest[1:]]
    serve(rest)


if __name__ == "__main__":
    main()
